"""Speculative decoding's part of the step: drafts in, their verdicts counted, drafts
for the next step planned.

    sampled    each request that verified drafts: how many it kept (``SpecStats``, and
               the adaptive draft length's acceptance per position)
    updated    the proposer absorbs the step's rows (MTP: its own KV, draft 1), then,
               for the running requests about to decode that may be drafted for, k
               drafts each (k: the config's, the adaptive length's choice, 0 past
               ``disable_by_batch_size``), cut by the dynamic verify budget

The verification itself is the sampler's (``Sampler.verify``); the scheduler hands the
drafts to the model runner with the request's token.
"""

from __future__ import annotations

import dataclasses
import time

from pdmesh.shared.engine.config import EngineConfig
from pdmesh.shared.engine.draft_length import DraftLength
from pdmesh.shared.engine.model_runner import ModelRunner
from pdmesh.shared.engine.request import Request
from pdmesh.shared.engine.scheduler import Scheduler
from pdmesh.shared.engine.spec_decode import (
    Proposer,
    SpecStats,
    SpeculativeConfig,
    VerifyBudget,
    drafts_allowed,
)
from pdmesh.shared.engine.step_hooks import StepHook, StepRecord
from pdmesh.shared.models.config import ModelConfig
from pdmesh.shared.models.deepseek_v4 import DeepseekV4
from pdmesh.shared.models.transformer import CausalLM


class Speculation(StepHook):
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, scheduler: Scheduler,
                 runner: ModelRunner, stats: SpecStats):
        self.config = config
        self.proposer = proposer
        self.scheduler = scheduler
        self.runner = runner
        self.stats = stats
        self.verify_budget = None if config.dynamic is None else VerifyBudget(
            config.dynamic, config.num_speculative_tokens)
        self.draft_length = DraftLength(config.num_speculative_tokens) \
            if config.adaptive else None

    def sampled(self, step: StepRecord) -> None:
        for i in step.sample_idx:
            drafts = step.sched.drafts.get(step.sched.requests[i])
            if drafts is None:
                continue
            drafted, accepted = len(drafts.tokens), len(step.tokens[i]) - 1
            self.stats.record(drafted, accepted)
            if self.draft_length is not None:
                self.draft_length.record_verified(drafted, accepted)

    def updated(self, step: StepRecord) -> None:
        t_proposer = time.perf_counter()
        ready, k = self._draft_plan()
        if self.proposer.needs_hidden:
            rows, self.runner.last_rows = self.runner.last_rows, None
            if k or not ready:
                self.proposer.absorb(rows, step.held)
            else:  # no drafts next step: the proposer's state has a gap
                self.proposer.skip(rows)
        if ready and k:
            self._propose(ready, k)
        if self.draft_length is not None:
            if ready and k:
                self.draft_length.record_proposer(len(ready), k,
                                                  time.perf_counter() - t_proposer)
            if not step.prompt_tokens:
                self.draft_length.record_step(step.sched.total_tokens,
                                              t_proposer - step.started)

    def _draft_plan(self) -> tuple[list[Request], int]:
        """The running requests about to decode whose sampling verification reproduces
        exactly and that the proposer can draft for, and how many drafts each is to
        verify next step (0: none)."""
        running, waiting = self.scheduler.running, self.scheduler.waiting
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        ready = [r for r in decoding if drafts_allowed(r) and self.proposer.can_draft(r)]
        most = self.config.disable_by_batch_size
        if not ready or (most is not None and len(running) + len(waiting) > most):
            return ready, 0
        k = self.config.num_speculative_tokens
        if self.draft_length is not None:
            k = self.draft_length.choose(len(ready), len(decoding) - len(ready))
            # every decision ages the counts, none included: lengths not chosen for a
            # while are asked for again, and their step times measured afresh
            self.draft_length.record_asked(len(ready), k)
        self.stats.draft_length = k
        return ready, k

    def _propose(self, ready: list[Request], k: int) -> None:
        """Up to ``k`` drafts for each of ``ready`` for the next step."""
        proposed = self.proposer.propose(ready, k)
        if self.verify_budget is not None:
            proposed = self.verify_budget.apply(proposed)
        for req, drafts in zip(ready, proposed, strict=True):
            req.drafts = drafts if drafts.tokens else None


def speculative_config(config: EngineConfig, model: CausalLM | DeepseekV4,
                       model_config: ModelConfig) -> SpeculativeConfig | None:
    """The engine's speculative config, an MTP one checked against the loaded model
    (its MTP layers; ``num_speculative_tokens`` defaults to their number)."""
    raw = config.speculative_config
    spec = raw if raw is None or isinstance(raw, SpeculativeConfig) \
        else SpeculativeConfig.from_dict(raw)
    if spec is None or not spec.is_mtp:
        return spec
    not_run = getattr(model.w, "mtp_not_run", None)
    if not_run is not None:
        raise ValueError(f"speculative_config.method: mtp: {config.model}'s {not_run}; "
                         f"pdmesh runs DeepSeek-V4 MTP blocks with sliding-window "
                         f"attention only")
    layers = len(model.w.mtp)
    if not layers:
        raise ValueError(f"speculative_config.method: mtp needs the checkpoint's MTP "
                         f"layers; {config.model} has none (num_nextn_predict_layers "
                         f"{model_config.num_nextn_predict_layers})")
    if spec.num_speculative_tokens is None:
        spec = dataclasses.replace(spec, num_speculative_tokens=layers)
    if spec.dynamic is not None and spec.dynamic.method == "dspark":
        raise ValueError("dynamic_spec_config.method: dspark needs a draft model with "
                         f"a confidence head; {config.model}'s MTP layers have "
                         "none (dflash estimates confidence without one)")
    return spec
