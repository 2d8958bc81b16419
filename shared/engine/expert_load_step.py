"""The expert-load recorder's part of the step: the load the step's forward counted
closes a step of its window, in the phase it ran (a step with any prompt chunk is a
prefill step), for EPLB to read (``parallel/expert_load.py``)."""

from __future__ import annotations

from pdmesh.shared.engine.step_hooks import StepHook, StepRecord
from pdmesh.shared.parallel.expert_load import ExpertLoadRecorder


class ExpertLoadStep(StepHook):
    def __init__(self, recorder: ExpertLoadRecorder):
        self.recorder = recorder

    @classmethod
    def of(cls, recorder: ExpertLoadRecorder | None) -> ExpertLoadStep | None:
        """The hook for a model's recorder (None: it records no expert load)."""
        return None if recorder is None else cls(recorder)

    def executed(self, step: StepRecord) -> None:
        sched = step.sched
        self.recorder.end_step(is_prefill=any(
            n > 1 and r not in sched.drafts
            for r, n in zip(sched.requests, sched.num_tokens, strict=True)))
