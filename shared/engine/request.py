"""A request inside the engine, and its lifecycle.

    WAITING ──schedule──▶ RUNNING ──stop/length──▶ FINISHED_STOPPED / FINISHED_LENGTH
       ▲                    │
       └────preempt─────────┘  (blocks freed, KV recomputed when it runs again)
    any unfinished state ──abort──▶ FINISHED_ABORTED
    RUNNING ──an output its grammar refuses──▶ FINISHED_ERROR (the gateway answers 500,
        as vLLM answers its "error" finish)
    RUNNING ──no block, recompute scheduler──▶ FINISHED_RECOMPUTED (handed back to the
        gateway, which re-prefills prompt + output elsewhere and continues)

``token_ids`` holds prompt then output; ``num_computed_tokens`` of them have KV in the
paged cache. A request samples a new token in the step that computes its last token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdmesh.shared.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"  # taken out of the running set by DyntraLB, its KV kept
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_RECOMPUTED = "recomputed"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_RECOMPUTED,
             RequestStatus.FINISHED_ERROR}
_TRANSITIONS: dict[RequestStatus, set[RequestStatus]] = {
    RequestStatus.WAITING: {RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED,
                            RequestStatus.FINISHED_RECOMPUTED},  # (a prefetched one)
    RequestStatus.RUNNING: {RequestStatus.WAITING, RequestStatus.PAUSED, *_FINISHED},
    RequestStatus.PAUSED: {RequestStatus.RUNNING, RequestStatus.WAITING, *_FINISHED},
}


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely under the raw model distribution
    decoded_token: str | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(init=False)  # prompt + output
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hits at first schedule; -1 until scheduled
    num_preemptions: int = 0
    stop_reason: int | None = None  # the stop token that ended it, if any
    block_hashes: list[bytes] = field(default_factory=list)  # chained, one per full block
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    # one per prompt token its logits scored so far (the first has none: None), when
    # sampling_params.prompt_logprobs asks for them
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    kv_keys: list[str] = field(default_factory=list)  # pool keys of the saved prompt
    generator: torch.Generator | None = None
    stop_ids: frozenset[int] = field(init=False)  # tokens that end it: stop ids, eos
    # for metrics: outputs it arrived with, when it was first scheduled, when this
    # engine produced its first token (time.monotonic)
    num_carried_outputs: int = 0
    scheduled_time: float | None = None
    first_token_time: float | None = None
    kv_get_time: tuple[float, float] | None = None  # (start, end) of its pool load
    kv_put_time: tuple[float, float] | None = None  # (start, end) of its pool save
    kv_get_bytes: int = 0  # what its pool load and save moved
    kv_put_bytes: int = 0
    pool_gave_up: bool = False  # its pool read timed out: it computes its prompt here
    # speculative decoding: what the proposer drafted after its last token, verified in
    # its next step (spec_decode.Drafts; None: it decodes one token)
    drafts: Any = None
    grammar: Any = None  # structured.Grammar: its output's grammar (None: free output)
    # a pooling request (pooling.Pooling): its prompt ends in ``embedding``, not tokens;
    # ``pooled``: the rows pooled so far (a MEAN's sum, over prompt rows < pooled_upto)
    pooling: Any = None
    pooled: Any = None
    pooled_upto: int = 0
    embedding: list[float] | None = None
    # return_hidden_states: the final hidden state of the last row it was fed, and how
    # many forwards fed it here
    last_hidden: list[float] | None = None
    forwards: int = 0
    # a LoRA adapter (models.lora.LoRARequest; None: the base model), and the root its
    # block hashes chain from (the adapter's own: its KV is never another's)
    lora: Any = None
    hash_root: bytes | None = None

    def timing(self) -> dict[str, object]:
        """When things happened to it here (time.monotonic), for traces."""
        return {"arrival": self.arrival_time, "scheduled": self.scheduled_time,
                "first_token": self.first_token_time, "kv_get": self.kv_get_time,
                "kv_put": self.kv_put_time, "kv_get_bytes": self.kv_get_bytes,
                "kv_put_bytes": self.kv_put_bytes}

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        sp = self.sampling_params
        eos = () if sp.ignore_eos else self.eos_token_ids
        self.stop_ids = frozenset((*sp.stop_token_ids, *eos))
        if sp.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        if self.sampling_params.seed is not None:
            import torch  # (not at import: gRPC edge processes read this module too)

            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: every prompt position is
        computed here, none taken from a prefix cache or the pool."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens)

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position must be computed here (none from a prefix cache or
        the pool): its prompt's logprobs are asked, or its pooling reads every row."""
        return self.wants_prompt_logprobs or (
            self.pooling is not None and self.pooling.every_row and self.embedding is None)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None

    def transition(self, new: RequestStatus) -> None:
        if new not in _TRANSITIONS.get(self.status, set()):
            raise RuntimeError(f"request {self.request_id}: {self.status.name} -> {new.name}")
        self.status = new

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
