"""The engine protocol: every message between a service's edge and its engine, typed.

    edge (gRPC, asyncio)                                      engine (steps in its thread)
      SubmitRequest(request_id, prompt, sampling, ...)   ──▶  admitted, or refused
      AbortRequest(request_id)                           ──▶  freed at once
      LoadQuery()                                        ──▶  EngineLoad, between steps
      LoraCommand(token, lora_name, ...)                 ──▶  TokenDelta(token), loaded or not
                                                        ◀──  StepOutputs([TokenDelta, ...])
                                                             one per engine step
                                                        ◀──  EngineLoad(...) every 0.1 s
      EdgeListening(port) | EdgeFailed(message)          ──▶  start-up (edge process only)

Every request submitted ends with exactly one final ``TokenDelta`` (``finished``): its
``finish_reason`` ("stop", "length", "abort", "recomputed"), or ``error`` when it was
refused (invalid, queue full, draining) or the engine failed. ``Status`` names why, and
is the one place a refusal becomes a status: gRPC's code of the same name at the
services' edges, an HTTP status at the gateway (``services.gateway.errors``).

The messages are msgspec structs; ``encode`` / ``FrameReader`` are the one codec (a
4-byte big-endian length, then msgpack) for the engine <-> edge socket pair. Nothing
here imports torch or grpc: an edge process stays light.
"""

from __future__ import annotations

import enum
import struct
from typing import Any

import msgspec

from pdmesh.shared.engine.pooling import PoolingParams
from pdmesh.shared.engine.request import Logprob
from pdmesh.shared.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    """Why a request ended without finishing (names as gRPC's status codes)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # the request's own fault: never retried
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # at --max-queued-requests: retry elsewhere
    UNAVAILABLE = "UNAVAILABLE"  # draining, or the engine failed or is gone: go elsewhere
    NOT_FOUND = "NOT_FOUND"  # what it names is not here (a LoRA adapter to unload)


class EngineRefused(Exception):
    """A request the engine will not run; ``status`` says why."""

    status = Status.UNAVAILABLE


class InvalidRequest(EngineRefused, ValueError):
    status = Status.INVALID_ARGUMENT


class QueueFull(EngineRefused):
    """``limit`` requests already wait (not yet running) on this instance. Not the
    request's fault: the caller may retry later or elsewhere."""

    status = Status.RESOURCE_EXHAUSTED

    def __init__(self, limit: int):
        super().__init__(f"max_queued_requests: {limit} requests already wait on this "
                         f"instance (the limit); retry later or on another instance")
        self.limit = limit


class NotFound(EngineRefused):
    status = Status.NOT_FOUND


class Draining(EngineRefused):
    """The instance is shutting down gracefully: go to another one."""


class Failure(msgspec.Struct, frozen=True):
    status: Status
    message: str


def failure_of(error: Exception) -> Failure:
    """The one refusal -> status mapping: an EngineRefused carries its status, a
    ValueError is the request's fault, anything else is the engine failing."""
    if isinstance(error, EngineRefused):
        return Failure(error.status, str(error))
    if isinstance(error, ValueError):
        return Failure(Status.INVALID_ARGUMENT, str(error))
    return Failure(Status.UNAVAILABLE, f"engine failed: {error}")


class TokenDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one engine step added to one request: the tokens the gateway streams.

    The same type on every hop until the SSE writer: the engine builds it from a step,
    the edge process receives it, the gateway rebuilds it from the gRPC chunk. On the
    socket pair it travels as a compact array without its trailing defaults (most
    deltas: the id, the new tokens, the cached count)."""

    request_id: str
    token_ids: list[int] = msgspec.field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens found in a prefix cache or the pool
    logprobs: list[dict[int, Logprob]] = msgspec.field(default_factory=list)
    finish_reason: str | None = None  # set on the last delta of a finished request
    stop_reason: int | None = None  # the stop token that ended it
    kv_keys: list[str] = msgspec.field(default_factory=list)  # pool keys of the prompt
    timing: dict[str, Any] | None = None  # when things happened to it (monotonic), at the end
    error: Failure | None = None  # refused or failed: the last delta, no tokens
    # with the first token computed here, when asked: one per prompt token (first: None)
    prompt_logprobs: list[dict[int, Logprob] | None] = msgspec.field(default_factory=list)
    # a pooling request's last delta: its prompt's embedding (no tokens)
    embedding: list[float] = msgspec.field(default_factory=list)
    # the last delta, when return_hidden_states asked (sampling_params.py)
    hidden_states: list[float] = msgspec.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def then(self, more: TokenDelta) -> TokenDelta:
        """This delta followed by ``more`` of the same request, as one (a reader that
        fell behind gets the steps it missed together)."""
        return TokenDelta(self.request_id, self.token_ids + more.token_ids,
                          self.num_cached_tokens or more.num_cached_tokens,
                          self.logprobs + more.logprobs, more.finish_reason,
                          more.stop_reason, more.kv_keys or self.kv_keys, more.timing,
                          more.error, self.prompt_logprobs or more.prompt_logprobs,
                          more.embedding, more.hidden_states)


def refused(request_id: str, error: Exception) -> TokenDelta:
    """The final delta of a request that will not run."""
    return TokenDelta(request_id, error=failure_of(error))


# -- edge -> engine ----------------------------------------------------------------------
class SubmitRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int | None = None  # None: the engine's default
    output_token_ids: list[int] = msgspec.field(default_factory=list)  # carried (hand-back)
    # an embedding request (a pooling engine's only kind): its own pooling fields
    pooling: PoolingParams | None = None
    lora_name: str | None = None  # the LoRA adapter it runs (None: the base model)
    # the adapter's folder, where the mesh serves it: an engine that has not loaded
    # the adapter reads it from there
    lora_path: str | None = None


class LoraCommand(msgspec.Struct, tag=True):
    """Load (vLLM's load_lora_adapter) or unload an adapter between steps; the answer
    is one finished TokenDelta under ``token``: an error, or none."""

    token: str
    lora_name: str
    lora_path: str = ""  # (load only)
    unload: bool = False


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str


class LoadQuery(msgspec.Struct, tag=True):
    """Answer with an EngineLoad now (between steps)."""


class EdgeListening(msgspec.Struct, tag=True):
    port: int


class EdgeFailed(msgspec.Struct, tag=True):
    message: str  # names the flag: "--port: cannot listen on ..."


# -- engine -> edge ----------------------------------------------------------------------
class StepOutputs(msgspec.Struct, tag=True):
    deltas: list[TokenDelta]


class EngineLoad(msgspec.Struct, tag=True):
    """How loaded the engine is; the registry and the routers read it."""

    running: int = 0
    waiting: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens admitted or waiting, not yet computed
    block_size: int = 0  # tokens per KV block (routers estimate prefix-cache hits with it)
    placement_version: int = 0  # the EPLB expert placement this rank runs
    expert_bytes_moved: int = 0  # expert weights this rank received in placement changes
    # what a step costs here (0: not measured yet): routers keep offloaded prompts off a
    # decode instance whose step they would push past the TPOT budget
    decode_step_us: int = 0  # a decode-only step
    prefill_ns_per_token: int = 0  # what each prompt token computed in a step adds
    max_num_batched_tokens: int = 0  # the most prompt tokens one step computes
    draining: bool = False
    max_model_len: int = 0
    # how long the engine has had work without finishing a step (0: it steps, or has
    # nothing to do): routers stop sending to a stalled instance and move its streams
    stalled_ms: int = 0
    # speculative decoding since start (0 and 0: it drafts nothing)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # the KV tiers (engine/kv_tiers.py; 0s: none): the host tier's blocks and capacity,
    # the blocks read back from it and from storage, the blocks asked of them
    tier_host_blocks: int = 0
    tier_host_capacity: int = 0
    tier_host_hits: int = 0
    tier_storage_hits: int = 0
    tier_queries: int = 0
    # the LoRA adapters in host memory (routers send an adapter's requests where it is)
    lora_adapters: list[str] = msgspec.field(default_factory=list)

    def registry_fields(self) -> dict[str, int]:
        """The load the instance publishes in the registry."""
        fields = msgspec.structs.asdict(self)
        del fields["draining"]  # (published on its own: Registry.mark_draining)
        del fields["lora_adapters"]  # (published as the instance's adapters)
        return fields


ToEngine = (SubmitRequest | AbortRequest | LoadQuery | LoraCommand | EdgeListening
            | EdgeFailed)
FromEngine = StepOutputs | EngineLoad

# -- the codec ---------------------------------------------------------------------------
HEADER = struct.Struct("!I")
_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    """One framed message: its length, then its msgpack."""
    body = _encoder.encode(message)
    return HEADER.pack(len(body)) + body


class FrameReader:
    """Bytes in, whole messages of ``kind`` (a union of the structs above) out."""

    def __init__(self, kind: Any):
        self._decoder = msgspec.msgpack.Decoder(kind)
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        out = []
        start = 0
        while len(self._buf) - start >= HEADER.size:
            (n,) = HEADER.unpack_from(self._buf, start)
            end = start + HEADER.size + n
            if len(self._buf) < end:
                break
            out.append(self._decoder.decode(memoryview(self._buf)[start + HEADER.size:end]))
            start = end
        del self._buf[:start]
        return out

    def decode_one(self, body: bytes) -> Any:
        return self._decoder.decode(body)
