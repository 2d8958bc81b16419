"""Decode's gRPC edge (grpc.aio: one event-loop thread serves every stream while the
engine steps in the main thread). Lifecycle of a request here:

    Generate(prompt, tokens so far, pool keys) -> engine loop: admitted (the prompt's
    blocks pulled from the pool into the paged cache; anything missing is recomputed)
    -> joins the continuous batch -> tokens streamed as they come (tokens that queued
    up while the reader was busy go out in one chunk) -> the last chunk carries
    finish_reason. Cancelling the stream aborts the request and frees its blocks at once.
    With --max-queued-requests, a request arriving while that many wait is refused with
    RESOURCE_EXHAUSTED (on a Session: that request's error_code).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdmesh.services.prefill.server import load_proto
from pdmesh.shared.infra.tracing import Tracing
from pdmesh.shared.proto import common_pb2, decode_pb2, decode_pb2_grpc
from pdmesh.shared.proto.convert import logprobs_to_proto, sampling_from_proto
from pdmesh.shared.runtime.loop import (
    AsyncRequestStream,
    Draining,
    EngineLoop,
    QueueFull,
    SessionSink,
    StreamEvent,
)

log = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, loop: EngineLoop, model_name: str, idle_timeout_s: float = 600.0,
                 role: str = "decode", tracing: Tracing | None = None):
        self.loop = loop
        self.role = role
        self.model_name = model_name
        self.idle_timeout_s = idle_timeout_s
        self.tracing = tracing or Tracing("pdmesh-decode", None)
        self._spans: dict[str, object] = {}  # request id -> its server span (tracing on)
        self._last_events: dict[str, StreamEvent] = {}

    def _begin_span(self, request, carrier) -> None:
        if self.tracing.enabled:
            self._spans[request.request_id] = self.tracing.start(
                self.role, self.tracing.extract(carrier), kind="server", attributes={
                    "pdmesh.request_id": request.request_id,
                    "pdmesh.prompt_tokens": len(request.prompt_token_ids),
                    "pdmesh.carried_tokens": len(request.output_token_ids)})

    def _end_span(self, rid: str, event: StreamEvent | None) -> None:
        span = self._spans.pop(rid, None) if self._spans else None
        if span is None:
            return
        if event is not None and event.timing:
            t = event.timing
            if t["kv_get"]:
                self.tracing.record("kv.get", span, *t["kv_get"])
            self.tracing.record("queue", span, t["arrival"], t["scheduled"])
            self.tracing.record("first_token", span, t["scheduled"], t["first_token"])
            span.set_attribute("pdmesh.finish_reason", event.finish_reason or "")
        if event is not None and event.error:
            span.set_attribute("pdmesh.error", event.error)
        span.end()

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        self._begin_span(request, dict(context.invocation_metadata())
                         if self.tracing.enabled else {})
        try:
            async for chunk in self._generate(request, context):
                yield chunk
        finally:
            self._end_span(request.request_id,
                           self._last_events.pop(request.request_id, None))

    async def _generate(self, request, context):
        try:
            params = sampling_from_proto(request.sampling)
            stream = self.loop.submit(list(request.prompt_token_ids), params,
                                      request_id=request.request_id or None,
                                      priority=request.priority,
                                      output_token_ids=list(request.output_token_ids),
                                      aio_loop=asyncio.get_running_loop())
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Draining as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        assert isinstance(stream, AsyncRequestStream)
        finished = False
        try:
            while not finished:
                event = await asyncio.wait_for(stream.next(), self.idle_timeout_s)
                if event.error:
                    if event.error_code is not None:  # refused, not started
                        finished = True
                    await context.abort(_status(event.error_code), event.error)
                chunk = decode_pb2.GenerateChunk()
                _fill_chunk(chunk, event)
                finished = event.finished
                if finished and self._spans:
                    self._last_events[request.request_id] = event
                yield chunk
        finally:
            if not finished:  # cancelled, timed out or failed: free the request's blocks
                self.loop.abort(stream.request_id)

    async def Session(self, request_iterator, context):  # noqa: N802
        sink = SessionSink(asyncio.get_running_loop())
        live: set[str] = set()
        rejected: dict[str, grpc.StatusCode] = {}  # refused at submission, and why
        reader = asyncio.create_task(self._read_session(request_iterator, sink, live,
                                                        rejected))
        try:
            while True:
                if not sink.ready.is_set():
                    if reader.done() and not live:
                        return  # the client closed its side and nothing is running
                    waiter = asyncio.create_task(sink.ready.wait())
                    await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    if reader.done() and reader.exception() is not None:
                        return  # the client went away: the finally aborts what is left
                    continue
                out = decode_pb2.SessionOutputs()
                for rid, event in _merged(sink.take()):
                    if rid not in live and event.error is None:
                        continue  # aborted by the client; nothing more to tell it
                    item = out.outputs.add(request_id=rid)
                    if event.error is not None:
                        code = rejected.pop(rid, None) or _status(event.error_code)
                        item.error_code = code.value[0]
                        item.error_message = event.error
                        live.discard(rid)
                        self._end_span(rid, event)
                        continue
                    _fill_chunk(item.chunk, event)
                    if event.finished:
                        live.discard(rid)
                        self._end_span(rid, event)
                if out.outputs:
                    yield out
        finally:
            reader.cancel()
            for rid in live:  # the stream ended early: free every running request's blocks
                self.loop.abort(rid)
                self._end_span(rid, None)

    async def _read_session(self, requests, sink: SessionSink, live: set[str],
                            rejected: dict[str, grpc.StatusCode]) -> None:
        async for msg in requests:
            if msg.HasField("generate"):
                req = msg.generate
                try:
                    params = sampling_from_proto(req.sampling)
                    self.loop.submit(list(req.prompt_token_ids), params,
                                     request_id=req.request_id or None, priority=req.priority,
                                     output_token_ids=list(req.output_token_ids), sink=sink)
                except (QueueFull, Draining, ValueError) as e:  # the limit, draining, or
                    rejected[req.request_id] = (                   # the client's fault
                        grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(e, QueueFull)
                        else grpc.StatusCode.UNAVAILABLE if isinstance(e, Draining)
                        else grpc.StatusCode.INVALID_ARGUMENT)
                    sink.push(req.request_id, StreamEvent([], finished=True, error=str(e)))
                    continue
                live.add(req.request_id)
                self._begin_span(req, req.trace_context)
            elif msg.abort_request_id:
                if msg.abort_request_id in live:
                    live.discard(msg.abort_request_id)
                    self.loop.abort(msg.abort_request_id)

    async def Health(self, request, context):  # noqa: N802
        await self.loop.refresh()
        return common_pb2.HealthResponse(serving=not self.loop.draining, role=self.role,
                                         model=self.model_name,
                                         load=load_proto(self.loop))


def _status(code: str | None) -> grpc.StatusCode:
    """A refusal's gRPC status (an engine failure when none is given)."""
    return grpc.StatusCode[code] if code else grpc.StatusCode.UNAVAILABLE


def _fill_chunk(chunk: decode_pb2.GenerateChunk, event: StreamEvent) -> None:
    chunk.token_ids.extend(event.token_ids)
    if event.logprobs:
        chunk.logprobs.extend(logprobs_to_proto(lp) for lp in event.logprobs)
    if event.finish_reason:
        chunk.finish_reason = event.finish_reason
    if event.num_cached_tokens:
        chunk.num_cached_tokens = event.num_cached_tokens
    if event.stop_reason is not None:
        chunk.stop_reason = event.stop_reason


def _merged(items: list[tuple[str, StreamEvent]]) -> list[tuple[str, StreamEvent]]:
    """One event per request: steps that piled up while the writer was busy merge."""
    merged: dict[str, StreamEvent] = {}
    for rid, ev in items:
        prev = merged.get(rid)
        merged[rid] = ev if prev is None or prev.finished else prev.then(ev)
    return list(merged.items())
