"""What a step costs on this engine, learned from the steps it runs: a decode-only step's
time and what each prompt token computed in a step adds to it. Routers read them (through
the registry) to keep prefill work off a decode instance whose TPOT it would break."""

from __future__ import annotations

import time

from pdmesh.shared.engine.step_hooks import StepHook, StepRecord

ALPHA = 0.2  # weight of the newest step in the running averages


class StepCosts(StepHook):
    def __init__(self) -> None:
        self.decode_step_us = 0.0  # 0: not measured yet
        self.prefill_ns_per_token = 0.0

    def record(self, seconds: float, prefill_tokens: int, decode_rows: int) -> None:
        """One step: its wall time, the prompt tokens it computed and its decode rows."""
        us = seconds * 1e6
        if not prefill_tokens:
            if decode_rows:
                self.decode_step_us = _ewma(self.decode_step_us, us)
            return
        # what the prompt tokens added over a decode step of the same rows (all of the
        # step's time when it decoded nothing: an upper bound, which errs on the side of
        # the decode streams)
        extra = us - self.decode_step_us if decode_rows and self.decode_step_us else us
        self.prefill_ns_per_token = _ewma(self.prefill_ns_per_token,
                                          max(0.0, extra) * 1e3 / prefill_tokens)

    def updated(self, step: StepRecord) -> None:
        self.record(time.perf_counter() - step.started, step.prompt_tokens, step.num_decoding)


def _ewma(old: float, new: float) -> float:
    return new if not old else (1 - ALPHA) * old + ALPHA * new
