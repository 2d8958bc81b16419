"""Prefill's gRPC edge (grpc.aio: one event-loop thread serves every request while the
engine steps in the main thread). Lifecycle of a request here:

    Prefill(prompt) -> engine loop: admitted (prompt blocks already in the pool are
    loaded, not computed) -> chunked prefill -> first token sampled -> prompt blocks
    (full ones and the partial tail) put in the pool -> answer {first token, keys,
    cached tokens}. A client that goes away aborts the request and frees its blocks.
    With --max-queued-requests, a request arriving while that many wait is refused
    with RESOURCE_EXHAUSTED (the gateway tries another instance).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc

from pdmesh.shared.infra.tracing import Tracing
from pdmesh.shared.proto import common_pb2, prefill_pb2, prefill_pb2_grpc
from pdmesh.shared.proto.convert import logprobs_to_proto, sampling_from_proto
from pdmesh.shared.runtime.loop import AsyncRequestStream, Draining, EngineLoop, QueueFull

log = logging.getLogger(__name__)


def load_proto(loop: EngineLoop) -> common_pb2.WorkerLoad:
    ld = loop.load()
    return common_pb2.WorkerLoad(running=ld.running, waiting=ld.waiting,
                                 free_kv_blocks=ld.free_kv_blocks,
                                 total_kv_blocks=ld.total_kv_blocks,
                                 queued_prefill_tokens=ld.queued_prefill_tokens)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, loop: EngineLoop, model_name: str, timeout_s: float = 600.0,
                 tracing: Tracing | None = None):
        self.loop = loop
        self.tracing = tracing or Tracing("pdmesh-prefill", None)
        self.model_name = model_name
        self.timeout_s = timeout_s

    async def Prefill(self, request, context):  # noqa: N802 (gRPC method name)
        span = None
        if self.tracing.enabled:
            parent = self.tracing.extract(dict(context.invocation_metadata()))
            span = self.tracing.start("prefill", parent, kind="server", attributes={
                "pdmesh.request_id": request.request_id,
                "pdmesh.prompt_tokens": len(request.prompt_token_ids)})
        try:
            return await self._prefill(request, context, span)
        finally:
            if span is not None:
                span.end()

    async def _prefill(self, request, context, span):
        try:
            params = sampling_from_proto(request.sampling)
            # this instance produces one token only (after any the request carries, when
            # a decode instance handed it back); decode does the rest
            carried = list(request.output_token_ids)
            first = dataclasses.replace(params, max_tokens=len(carried) + 1)
            stream = self.loop.submit(list(request.prompt_token_ids), first,
                                      request_id=request.request_id or None,
                                      priority=request.priority,
                                      output_token_ids=carried or None,
                                      aio_loop=asyncio.get_running_loop())
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Draining as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        assert isinstance(stream, AsyncRequestStream)
        try:
            event = await asyncio.wait_for(stream.next(), self.timeout_s)
        except (asyncio.CancelledError, TimeoutError):
            self.loop.abort(stream.request_id)  # the caller left or gave up
            raise
        if event.error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, event.error)
        if event.finish_reason == "abort":
            await context.abort(grpc.StatusCode.CANCELLED,
                                f"request {stream.request_id} aborted")
        # the token ends the request by itself when it is a stop token, the caller asked
        # for no more, or the context is full
        total = len(request.prompt_token_ids) + len(carried) + 1
        finish = "stop" if event.finish_reason == "stop" else (
            "length" if params.max_tokens == len(carried) + 1
            or total >= self.loop.max_model_len else "")
        resp = prefill_pb2.PrefillResponse(
            first_token=event.token_ids[0], block_keys=event.kv_keys,
            num_cached_tokens=event.num_cached_tokens,
            num_prompt_tokens=len(request.prompt_token_ids), finish_reason=finish)
        if event.logprobs:
            resp.first_logprobs.CopyFrom(logprobs_to_proto(event.logprobs[0]))
        if span is not None and event.timing:
            t = event.timing
            span.set_attribute("pdmesh.cached_tokens", event.num_cached_tokens)
            self.tracing.record("queue", span, t["arrival"], t["scheduled"])
            self.tracing.record("compute", span, t["scheduled"], t["first_token"])
            if t["kv_get"]:
                self.tracing.record("kv.get", span, *t["kv_get"])
            if t["kv_put"]:
                self.tracing.record("kv.put", span, *t["kv_put"],
                                    attributes={"pdmesh.blocks": len(event.kv_keys)})
        return resp

    async def Health(self, request, context):  # noqa: N802
        return common_pb2.HealthResponse(serving=not self.loop.draining, role="prefill",
                                         model=self.model_name,
                                         load=load_proto(self.loop))
