"""What one engine step shows the features that hook into it.

    EngineCore.step():  schedule ─▶ execute ─▶ sample ─▶ update ─▶ outputs
                                       │          │         │
                                   executed    sampled   updated     each StepHook, in order

The step itself never names a feature. One that needs the step (the prefill instance's
prompt saves, the speculative proposer, the expert-load recorder, the step-cost model)
is a ``StepHook`` that ``build_engine`` hands to the engine; each lives in a module of
its own (``prompt_saves``, ``speculation``, ``expert_load_step``, ``step_costs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from pdmesh.shared.engine.request import Request
from pdmesh.shared.engine.scheduler import SchedulerOutput


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request: Request
    new_token_ids: list[int]
    finished: bool


@dataclass
class StepRecord:
    """One step, as its hooks see it; filled in as the step goes."""

    sched: SchedulerOutput
    started: float  # time.perf_counter() as the step began, before scheduling
    # positions in ``sched.requests`` whose last computed row is sampled this step
    sample_idx: list[int] = field(default_factory=list)
    # position -> its sampled token, or (a request that verified drafts) the tokens kept
    tokens: dict[int, Any] = field(default_factory=dict)
    finished: list[Request] = field(default_factory=list)  # what the update finished
    # id() of requests whose end a hook holds back (a prompt whose pool put is pending):
    # they come out unfinished now and finish with the hook's own outputs
    held: set[int] = field(default_factory=set)

    @cached_property
    def _decoding(self) -> list[int]:
        """The tokens of each request that decodes: one, or a token and its drafts."""
        return [n for r, n in zip(self.sched.requests, self.sched.num_tokens, strict=True)
                if n == 1 or r in self.sched.drafts]

    @property
    def num_decoding(self) -> int:
        """Rows that decode."""
        return len(self._decoding)

    @property
    def prompt_tokens(self) -> int:
        """Tokens of prompts (and of carried outputs) this step computed."""
        return self.sched.total_tokens - sum(self._decoding)

    def outputs(self) -> list[StepOutput]:
        """What the step gives its caller: each sampled request's new token(s), finished
        unless a hook holds it back."""
        done = {id(r) for r in self.finished} - self.held
        reqs = self.sched.requests
        return [StepOutput(reqs[i], self.tokens[i] if reqs[i] in self.sched.drafts
                           else [self.tokens[i]], id(reqs[i]) in done)
                for i in self.sample_idx]


class StepHook:
    """A feature that hooks into the step. Each method runs on the step thread, in the
    order the engine was handed its hooks; the defaults do nothing."""

    def wants_hidden(self, requests: list[Request]) -> bool:
        """Before the forward: whether this step's final hidden states must be kept
        (``ModelRunner.last_rows``) for this hook's ``executed``."""
        return False

    def executed(self, step: StepRecord) -> None:
        """After the forward pass, before sampling (a raise here fails the step as the
        forward's would: the prefix cache is forgotten)."""

    def sampled(self, step: StepRecord) -> None:
        """After sampling, before the scheduler's update: ``step.tokens`` is known."""

    def updated(self, step: StepRecord) -> None:
        """After the update: ``step.finished`` is known and the requests have their
        tokens; the next step's plans (drafts) are made here."""
