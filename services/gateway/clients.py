"""The gateway's calls to engine instances, behind two small interfaces.

    PrefillClient.prefill(instance, call)   -> PrefillCall: first() the next token, then
                                               stored() the pool keys once put
    DecodeClient.generate(instance, call)   -> TokenDelta stream (closing it early aborts)

Both raise ``CallFailed`` with the gRPC code when an instance cannot answer. The journey
(``journey``) only knows these interfaces: the gRPC implementations here serve the
gateway, in-memory fakes serve the journey's unit tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from pdmesh.services.gateway.errors import CallFailed
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.infra import cluster_auth, tls
from pdmesh.shared.infra.registry import Instance
from pdmesh.shared.proto import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from pdmesh.shared.runtime.proto_convert import (
    delta_from_chunk,
    logprobs_from_proto,
    prompt_logprobs_from_proto,
    sampling_to_proto,
)
from pdmesh.shared.runtime.protocol import TokenDelta

_CODES = {c.value[0]: c for c in grpc.StatusCode}
STALL_POLL_S = 1.0  # how often a silent decode stream checks its instance is alive
# a first token's answer carries the prompt's logprobs when asked: up to 21 entries per
# prompt token (gRPC's 4 MiB default would refuse a 16k-token prompt's top 20)
_RECEIVE = [("grpc.max_receive_message_length", -1)]


@dataclass
class Call:
    """One call to one instance on behalf of a request."""

    request_id: str  # unique per attempt: the instance keys its request by it
    prompt: list[int]
    sampling: SamplingParams
    priority: int | None = None
    carried: list[int] = field(default_factory=list)  # tokens generated before this call
    block_keys: list[str] = field(default_factory=list)  # where the prompt's KV waits
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C, when tracing
    lora_name: str | None = None  # the LoRA adapter it runs (None: the base model)
    lora_path: str | None = None  # its folder


@dataclass
class Stored:
    """The end of a prefill: the prompt's KV is in the pool under ``block_keys``."""

    block_keys: list[str]
    finish_reason: str | None = None  # the first token already ended the request


class PrefillCall(Protocol):
    """One prefill under way. The first token comes as soon as it is sampled; the
    prompt's put into the pool ends after it."""

    async def first(self) -> TokenDelta:
        """The next token (no ``finish_reason``: ``stored`` says whether it ended)."""

    async def stored(self) -> Stored:
        """The prompt's blocks are in the pool (a decode instance can load them)."""

    def cancel(self) -> None:
        """Give up on the call (the instance aborts the request)."""


class PrefillClient(Protocol):
    def prefill(self, inst: Instance, call: Call, timeout_s: float) -> PrefillCall:
        """Compute the prompt (and ``call.carried``), sample one more token."""


Stall = tuple[float, Callable[[], bool]]  # (seconds of silence, is the instance alive?)


class DecodeClient(Protocol):
    def generate(self, inst: Instance, call: Call, idle_timeout_s: float,
                 stall: Stall | None = None) -> AsyncIterator[TokenDelta]:
        """The request's deltas until the one that finishes it. ``stall``: after that
        many seconds without a token, the call fails as soon as the instance is not
        alive (UNAVAILABLE), without waiting for ``idle_timeout_s``."""


class GrpcClients:
    """Both clients over gRPC: one channel per address and, for decode, one Session
    stream per instance that every request shares."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._sessions: dict[str, DecodeSession] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = tls.aio_channel(address, _RECEIVE)
        return ch

    def prefill(self, inst: Instance, call: Call, timeout_s: float) -> PrefillCall:
        stub = prefill_pb2_grpc.PrefillStub(self.channel(inst.address))
        return GrpcPrefillCall(call.request_id, stub.Prefill(prefill_pb2.PrefillRequest(
            request_id=call.request_id, prompt_token_ids=call.prompt,
            sampling=sampling_to_proto(call.sampling), priority=call.priority,
            output_token_ids=call.carried, lora_name=call.lora_name or "",
            lora_path=call.lora_path or ""),
            timeout=timeout_s, metadata=(*call.trace_context.items(),
                                         *cluster_auth.call_metadata()) or None))

    def generate(self, inst: Instance, call: Call, idle_timeout_s: float,
                 stall: Stall | None = None) -> AsyncIterator[TokenDelta]:
        return self.session(inst.address).generate(decode_pb2.GenerateRequest(
            request_id=call.request_id, prompt_token_ids=call.prompt,
            output_token_ids=call.carried, block_keys=call.block_keys,
            sampling=sampling_to_proto(call.sampling), priority=call.priority,
            trace_context=call.trace_context, lora_name=call.lora_name or "",
            lora_path=call.lora_path or ""),
            idle_timeout_s, stall)

    async def embed(self, inst: Instance, request: common_pb2.EmbedRequest,
                    timeout_s: float) -> common_pb2.EmbedResponse:
        """One prompt's embedding from a pooling instance (a prefill one answers on
        ``Prefill``, a mixed one on ``Decode``); CallFailed with the gRPC code."""
        channel = self.channel(inst.address)
        stub = (prefill_pb2_grpc.PrefillStub(channel) if inst.role == "prefill"
                else decode_pb2_grpc.DecodeStub(channel))
        try:
            return await stub.Embed(request, timeout=timeout_s,
                                    metadata=cluster_auth.call_metadata() or None)
        except grpc.aio.AioRpcError as e:
            raise CallFailed(e.code(), e.details() or "") from None

    async def lora_adapter(self, inst: Instance, request: common_pb2.LoraAdapterRequest,
                           timeout_s: float) -> None:
        """Load or unload a LoRA adapter on one engine instance; CallFailed with the
        gRPC code (INVALID_ARGUMENT: the adapter cannot run there)."""
        channel = self.channel(inst.address)
        stub = (prefill_pb2_grpc.PrefillStub(channel) if inst.role == "prefill"
                else decode_pb2_grpc.DecodeStub(channel))
        try:
            await stub.LoraAdapter(request, timeout=timeout_s,
                                   metadata=cluster_auth.call_metadata() or None)
        except grpc.aio.AioRpcError as e:
            raise CallFailed(e.code(), e.details() or "") from None

    def session(self, address: str) -> DecodeSession:
        """The live session to ``address``; a broken one is replaced."""
        s = self._sessions.get(address)
        if s is None or s.broken is not None:
            s = self._sessions[address] = DecodeSession(self.channel(address))
        return s

    async def close(self) -> None:
        for s in self._sessions.values():
            await s.close()
        for ch in self._channels.values():
            await ch.close()


class GrpcPrefillCall:
    """``Prefill``'s answer stream: the first token's message, then the one that says the
    prompt is stored (or both in one message)."""

    def __init__(self, request_id: str, rpc: grpc.aio.UnaryStreamCall):
        self._rid = request_id
        self._rpc = rpc
        self._end: prefill_pb2.PrefillResponse | None = None

    async def _read(self) -> prefill_pb2.PrefillResponse:
        try:
            msg = await self._rpc.read()
        except grpc.aio.AioRpcError as e:
            raise CallFailed(e.code(), e.details() or e.code().name) from e
        if msg is grpc.aio.EOF:
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, "prefill answer ended early")
        return msg

    async def first(self) -> TokenDelta:
        msg = await self._read()
        if msg.kv_stored:
            self._end = msg
        lps = [logprobs_from_proto(msg.first_logprobs)] if msg.HasField("first_logprobs") else []
        return TokenDelta(self._rid, [msg.first_token], msg.num_cached_tokens, lps,
                          prompt_logprobs=prompt_logprobs_from_proto(msg.prompt_logprobs))

    async def stored(self) -> Stored:
        msg = self._end or await self._read()
        return Stored(list(msg.block_keys), msg.finish_reason or None)

    def cancel(self) -> None:
        self._rpc.cancel()


class DecodeSession:
    """The gateway's one ``Decode.Session`` stream to a decode (or mixed) instance: many
    requests share it and each engine step arrives as one message. The session breaks
    as a whole when the instance goes away; every request on it then fails with
    UNAVAILABLE (or what gRPC reported) and the caller continues elsewhere."""

    def __init__(self, channel: grpc.aio.Channel):
        self._outbox: asyncio.Queue[decode_pb2.SessionRequest | None] = asyncio.Queue()
        self._waiters: dict[str, asyncio.Queue] = {}
        self.broken: CallFailed | None = None
        self._call = decode_pb2_grpc.DecodeStub(channel).Session(
            self._requests(), metadata=cluster_auth.call_metadata() or None)
        self._reader = asyncio.create_task(self._read())

    async def _requests(self) -> AsyncIterator[decode_pb2.SessionRequest]:
        while (msg := await self._outbox.get()) is not None:
            yield msg

    async def _read(self) -> None:
        try:
            async for msg in self._call:
                for out in msg.outputs:
                    q = self._waiters.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
            failure = CallFailed(grpc.StatusCode.UNAVAILABLE, "decode session closed")
        except grpc.aio.AioRpcError as e:
            failure = CallFailed(e.code(), e.details() or e.code().name)
        except asyncio.CancelledError:
            failure = CallFailed(grpc.StatusCode.CANCELLED, "gateway shutting down")
        self.broken = failure
        for q in self._waiters.values():
            q.put_nowait(failure)

    async def generate(self, req: decode_pb2.GenerateRequest, idle_timeout_s: float,
                       stall: Stall | None = None) -> AsyncIterator[TokenDelta]:
        """The request's deltas; CallFailed if it cannot finish here."""
        if self.broken is not None:
            raise self.broken
        rid = req.request_id
        q: asyncio.Queue = asyncio.Queue()
        self._waiters[rid] = q
        self._outbox.put_nowait(decode_pb2.SessionRequest(generate=req))
        finished = False
        clock = asyncio.get_running_loop().time
        poll = idle_timeout_s if stall is None else min(idle_timeout_s, STALL_POLL_S)
        try:
            while not finished:
                heard = clock()
                while True:
                    try:  # (not wait_for: Python 3.11's loses a cancel that comes
                        async with asyncio.timeout(poll):  # as the item does)
                            item = await q.get()
                        break
                    except TimeoutError:
                        silent = clock() - heard
                        if silent >= idle_timeout_s:
                            raise CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                                             f"no token for {idle_timeout_s:.0f} s") from None
                        if stall is not None and silent >= stall[0] and not stall[1]():
                            raise CallFailed(grpc.StatusCode.UNAVAILABLE,
                                             f"no token for {silent:.0f} s and the instance "
                                             f"stopped heartbeating (stalled)") from None
                if isinstance(item, CallFailed):
                    raise item
                if item.error_code:
                    finished = True  # the instance already forgot it
                    raise CallFailed(_CODES.get(item.error_code, grpc.StatusCode.UNKNOWN),
                                     item.error_message)
                finished = bool(item.chunk.finish_reason)
                yield delta_from_chunk(rid, item.chunk)
        finally:
            del self._waiters[rid]
            if not finished and self.broken is None:  # the client left: free its blocks
                self._outbox.put_nowait(decode_pb2.SessionRequest(abort_request_id=rid))

    async def close(self) -> None:
        self._outbox.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()
