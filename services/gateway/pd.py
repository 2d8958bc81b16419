"""One request's way through the mesh, as the gateway drives it.

    prefill (a live instance; on failure another one, with backoff)
      -> first token, the prompt's pool keys, cached-token count
    decode  (a live instance streams the rest)
      -> instance dies mid-stream? continue on another decode instance with the tokens
         so far: it loads the prompt from the pool and recomputes the rest, so the
         client's stream goes on unbroken
Errors the client caused (INVALID_ARGUMENT) go straight back; anything else that
cannot be recovered ends as ``MeshError`` with a clear message. An instance at its
--max-queued-requests answers RESOURCE_EXHAUSTED before doing anything: the request
goes to another instance, and when every one refused it, the MeshError is a 429.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdmesh.services.gateway.router import Router
from pdmesh.shared.engine.request import Logprob
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.proto import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from pdmesh.shared.proto.convert import logprobs_from_proto, sampling_to_proto

log = logging.getLogger(__name__)

PREFILL_ATTEMPTS = 3
DECODE_ATTEMPTS = 3
MAX_HAND_BACKS = 16  # times the recompute scheduler may hand one request back
BACKOFF_S = 0.1
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


class _Count:
    def inc(self, n: float = 1) -> None:
        pass


class MeshEvents:
    """What the mesh path reports (the gateway's metrics implement the same): a call
    retried on another instance, a request migrated to another decode instance, one
    handed back by a decode instance's recompute scheduler. These do nothing."""

    migrated = _Count()
    handed_back = _Count()
    offloaded = _Count()

    def retried(self, role: str) -> None:
        pass


class MeshError(Exception):
    """The mesh could not serve the request; ``status`` is the HTTP status to answer
    (429: every instance was at its queue limit, worth retrying a little later)."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(message)
        self.status = status


@dataclass
class Piece:
    """Tokens from the mesh, in order; the last one has ``finish_reason``."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int | None = None  # on the first piece only


class DecodeFailed(Exception):
    """A decode request ended without finishing: ``code`` says whose fault it was."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class DecodeSession:
    """The gateway's one ``Decode.Session`` stream to a decode (or mixed) instance: many
    requests share it and each engine step arrives as one message. The session breaks
    as a whole when the instance goes away; every request on it then fails with
    UNAVAILABLE (or what gRPC reported) and the caller continues elsewhere."""

    def __init__(self, channel: grpc.aio.Channel):
        self._outbox: asyncio.Queue[decode_pb2.SessionRequest | None] = asyncio.Queue()
        self._waiters: dict[str, asyncio.Queue] = {}
        self.broken: DecodeFailed | None = None
        self._call = decode_pb2_grpc.DecodeStub(channel).Session(self._requests())
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
            failure = DecodeFailed(grpc.StatusCode.UNAVAILABLE, "decode session closed")
        except grpc.aio.AioRpcError as e:
            failure = DecodeFailed(e.code(), e.details() or e.code().name)
        except asyncio.CancelledError:
            failure = DecodeFailed(grpc.StatusCode.CANCELLED, "gateway shutting down")
        self.broken = failure
        for q in self._waiters.values():
            q.put_nowait(failure)

    async def generate(self, req: decode_pb2.GenerateRequest, idle_timeout_s: float
                       ) -> AsyncIterator[decode_pb2.GenerateChunk]:
        """The request's chunks; DecodeFailed if it cannot finish here."""
        if self.broken is not None:
            raise self.broken
        rid = req.request_id
        q: asyncio.Queue = asyncio.Queue()
        self._waiters[rid] = q
        self._outbox.put_nowait(decode_pb2.SessionRequest(generate=req))
        finished = False
        try:
            while not finished:
                try:
                    item = await asyncio.wait_for(q.get(), idle_timeout_s)
                except TimeoutError:
                    raise DecodeFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       f"no token for {idle_timeout_s:.0f} s") from None
                if isinstance(item, DecodeFailed):
                    raise item
                if item.error_code:
                    finished = True  # the instance already forgot it
                    raise DecodeFailed(_CODES.get(item.error_code, grpc.StatusCode.UNKNOWN),
                                       item.error_message)
                finished = bool(item.chunk.finish_reason)
                yield item.chunk
        finally:
            del self._waiters[rid]
            if not finished and self.broken is None:  # the client left: free its blocks
                self._outbox.put_nowait(decode_pb2.SessionRequest(abort_request_id=rid))

    async def close(self) -> None:
        self._outbox.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()


class Channels:
    """One gRPC channel and one decode session per address, reused."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._sessions: dict[str, DecodeSession] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address)
        return ch

    def session(self, address: str) -> DecodeSession:
        """The live session to ``address``; a broken one is replaced."""
        s = self._sessions.get(address)
        if s is None or s.broken is not None:
            s = self._sessions[address] = DecodeSession(self.get(address))
        return s

    async def close(self) -> None:
        for s in self._sessions.values():
            await s.close()
        for ch in self._channels.values():
            await ch.close()


async def generate(router: Router, channels: Channels, request_id: str, prompt: list[int],
                   params: SamplingParams, priority: int = 0,
                   timeout_s: float = 600.0,
                   events: MeshEvents | None = None,
                   trace: tuple[Any, Any] | None = None) -> AsyncIterator[Piece]:
    """``trace``: (Tracing, the request's span): prefill and decode calls become its
    child spans and carry the context to the instances."""
    events = events or MeshEvents()
    sampling = sampling_to_proto(params)
    if not router.instances("prefill") and router.instances("mixed"):
        async for piece in _mixed(router, channels, request_id, prompt, sampling, priority,
                                  timeout_s):
            yield piece
        return
    offload = router.offload_target(prompt)
    tokens: list[int] = []
    keys: list[str] = []
    if offload is None:
        first = await _prefill(router, channels, request_id, prompt, sampling, priority,
                               timeout_s, events=events, trace=trace)
        lp = [logprobs_from_proto(first.first_logprobs)] if params.logprobs is not None else []
        yield Piece([first.first_token], lp, first.finish_reason or None,
                    first.num_cached_tokens)
        if first.finish_reason:
            return
        tokens = [first.first_token]
        keys = list(first.block_keys)
    else:  # prefill is backed up: this decode instance computes the prompt itself
        events.offloaded.inc()
        router.sent(offload, prompt)
    dead: set[str] = set()
    codes: list[grpc.StatusCode] = []  # why each decode instance failed
    handed_back = 0
    while len(dead) < DECODE_ATTEMPTS:
        inst = offload if offload is not None else router.pick("decode", exclude=dead)
        if inst is None:
            _raise_if_all_refused("decode", codes)
            raise MeshError("no decode instance is available")
        span = _child(trace, "decode", inst, {"pdmesh.attempt": len(dead),
                                             "pdmesh.carried_tokens": len(tokens)})
        chunks = channels.session(inst.address).generate(decode_pb2.GenerateRequest(
            request_id=f"{request_id}-d{len(dead)}r{handed_back}", prompt_token_ids=prompt,
            output_token_ids=tokens, block_keys=keys, sampling=sampling,
            priority=priority, trace_context=_carrier(trace, span)), timeout_s)
        recomputed = False
        try:
            async for chunk in chunks:
                if chunk.finish_reason == "recomputed":  # out of KV there (decode's
                    recomputed = True                     # recompute scheduler)
                    break
                cached = None
                if offload is not None:  # its first token: the prompt is done there
                    router.answered(offload, prompt)
                    cached, offload = chunk.num_cached_tokens, None
                tokens += chunk.token_ids
                yield Piece(list(chunk.token_ids),
                            [logprobs_from_proto(m) for m in chunk.logprobs]
                            if chunk.logprobs else [],
                            chunk.finish_reason or None, cached)
                if chunk.finish_reason:
                    return
        except DecodeFailed as e:
            if e.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise MeshError(e.details or "invalid request", 400) from e
            if e.code not in RETRYABLE:
                raise MeshError(f"decode failed: {e}") from e
            log.warning("request %s: decode %s failed (%s); continuing elsewhere after %d "
                        "tokens", request_id, inst.address, e.code.name, len(tokens))
            dead.add(inst.id)
            codes.append(e.code)
            events.retried("decode")
            if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:  # it had started there
                events.migrated.inc()
            router.forget()
            await asyncio.sleep(BACKOFF_S)
        finally:
            if offload is not None:  # ended before its first token: no longer queued
                router.answered(offload, prompt)
                offload = None
            await chunks.aclose()  # aborts the request on decode when the client left
            if span is not None:
                span.set_attribute("pdmesh.outcome", "handed back" if recomputed else
                                   "failed" if inst.id in dead else "finished")
                span.end()
        if recomputed:
            # re-prefill prompt + tokens so far, then continue on a decode instance: the
            # client's stream goes on as if nothing happened
            handed_back += 1
            events.handed_back.inc()
            if handed_back > MAX_HAND_BACKS:
                raise MeshError(f"decode handed the request back {MAX_HAND_BACKS} times "
                                "(out of KV cache); retry later")
            log.info("request %s: handed back by decode %s after %d tokens; re-prefilling",
                     request_id, inst.address, len(tokens))
            hop = _child(trace, "recompute", None, {"pdmesh.carried_tokens": len(tokens)})
            try:
                nxt = await _prefill(router, channels, f"{request_id}-r{handed_back}",
                                     prompt, sampling, priority, timeout_s,
                                     output_token_ids=tokens, events=events,
                                     trace=(trace[0], hop) if hop is not None else None)
            finally:
                if hop is not None:
                    hop.end()
            lp = ([logprobs_from_proto(nxt.first_logprobs)]
                  if params.logprobs is not None else [])
            tokens.append(nxt.first_token)
            yield Piece([nxt.first_token], lp, nxt.finish_reason or None)
            if nxt.finish_reason:
                return
            keys = list(nxt.block_keys)
    _raise_if_all_refused("decode", codes)
    raise MeshError(f"decode failed on {len(dead)} instances")


def _raise_if_all_refused(role: str, codes: list[grpc.StatusCode]) -> None:
    """A 429 when every instance tried refused the request at its queue limit."""
    if codes and all(c == grpc.StatusCode.RESOURCE_EXHAUSTED for c in codes):
        raise MeshError(f"every {role} instance tried ({len(codes)}) is at its "
                        f"--max-queued-requests limit; retry later", 429)


async def _mixed(router: Router, channels: Channels, request_id: str, prompt: list[int],
                 sampling, priority: int, timeout_s: float) -> AsyncIterator[Piece]:
    """A mixed instance prefills and decodes in one engine: one stream, no pool. An
    instance that refuses the request at its queue limit is replaced by another."""
    refused: list[grpc.StatusCode] = []
    tried: set[str] = set()
    for _ in range(PREFILL_ATTEMPTS):
        inst = router.pick("mixed", exclude=tried)
        if inst is None:
            break
        chunks = channels.session(inst.address).generate(
            decode_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                       sampling=sampling, priority=priority), timeout_s)
        first = True
        try:
            async for chunk in chunks:
                yield Piece(list(chunk.token_ids),
                            [logprobs_from_proto(m) for m in chunk.logprobs],
                            chunk.finish_reason or None,
                            chunk.num_cached_tokens if first else None)
                first = False
            return
        except DecodeFailed as e:
            if first and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                refused.append(e.code)  # nothing ran there: another instance may take it
                tried.add(inst.id)
                continue
            status = 400 if e.code == grpc.StatusCode.INVALID_ARGUMENT else 503
            raise MeshError(e.details or e.code.name, status) from e
        finally:
            await chunks.aclose()
    _raise_if_all_refused("mixed", refused)
    raise MeshError("no instance is available")


async def _prefill(router: Router, channels: Channels, request_id: str, prompt: list[int],
                   sampling, priority: int, timeout_s: float,
                   output_token_ids: list[int] | None = None,
                   events: MeshEvents | None = None,
                   trace: tuple[Any, Any] | None = None) -> prefill_pb2.PrefillResponse:
    """The next token from a prefill instance (retrying elsewhere, with backoff);
    ``output_token_ids``: tokens generated before a decode instance handed the request
    back, computed with the prompt."""
    carried = output_token_ids or []
    tried: set[str] = set()
    codes: list[grpc.StatusCode] = []  # why each attempt failed
    last = "no prefill instance is available"
    for attempt in range(PREFILL_ATTEMPTS):
        inst = router.pick("prefill", exclude=tried, prompt=prompt + carried)
        if inst is None:
            break
        stub = prefill_pb2_grpc.PrefillStub(channels.get(inst.address))
        router.sent(inst, prompt + carried)
        span = _child(trace, "prefill", inst, {"pdmesh.attempt": attempt})
        try:
            return await stub.Prefill(prefill_pb2.PrefillRequest(
                request_id=f"{request_id}-p{attempt}", prompt_token_ids=prompt,
                sampling=sampling, priority=priority, output_token_ids=carried),
                timeout=timeout_s, metadata=tuple(_carrier(trace, span).items()) or None)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise MeshError(e.details() or "invalid request", 400) from e
            last = f"prefill {inst.address} failed: {e.code().name}: {e.details()}"
            log.warning("request %s: %s", request_id, last)
            codes.append(e.code())
            if e.code() not in RETRYABLE:
                break
            tried.add(inst.id)
            router.forget()
            if events is not None:
                events.retried("prefill")
        finally:
            router.answered(inst, prompt + carried)
            if span is not None:
                span.end()
        await asyncio.sleep(BACKOFF_S * (2 ** attempt))
    _raise_if_all_refused("prefill", codes)
    raise MeshError(last)


def _child(trace: tuple[Any, Any] | None, name: str, inst: Any,
           attributes: dict[str, Any]) -> Any:
    """A client span under the request's span (None when not tracing); with ``inst``,
    the routing decision as attributes."""
    if trace is None:
        return None
    tracing, parent = trace
    if inst is not None:
        attributes = {**attributes, "pdmesh.instance": inst.id,
                      "pdmesh.address": inst.address,
                      "pdmesh.route": "least estimated TTFT" if name == "prefill"
                      else "fewest KV blocks in use"}
    return tracing.start(name, tracing.context_of(parent), kind="client",
                         attributes=attributes)


def _carrier(trace: tuple[Any, Any] | None, span: Any) -> dict[str, str]:
    """The W3C trace context of ``span``, to send along (empty when not tracing)."""
    if trace is None or span is None:
        return {}
    tracing = trace[0]
    return tracing.inject(tracing.context_of(span))
