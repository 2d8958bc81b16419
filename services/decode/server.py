"""Decode's gRPC edge (grpc.aio, in the edge process: shared.runtime.edge). A request's
life here:

    Session message "generate" (prompt, tokens so far, pool keys) -> the engine admits
    it (the prompt's blocks pulled from the pool into the paged cache; anything missing
    is recomputed) or refuses it -> it joins the continuous batch -> each engine step
    sends one SessionOutputs holding every request's new tokens (steps that queued up
    while the writer was busy go out merged) -> the last one carries finish_reason.

A refusal (invalid: INVALID_ARGUMENT, --max-queued-requests reached: RESOURCE_EXHAUSTED,
draining: UNAVAILABLE) is that request's only output, with ``error_code``. An "abort"
message, or the stream ending, aborts the request and frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pdmesh.shared.infra.tracing import Tracing
from pdmesh.shared.proto import common_pb2, decode_pb2, decode_pb2_grpc
from pdmesh.shared.runtime.client import EngineClient, SessionSink
from pdmesh.shared.runtime.embed_edge import embed
from pdmesh.shared.runtime.lora_edge import lora_adapter
from pdmesh.shared.runtime.proto_convert import (
    fill_chunk,
    grpc_code,
    load_to_proto,
    submit_from_proto,
)
from pdmesh.shared.runtime.protocol import TokenDelta, refused

log = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: EngineClient, model_name: str, role: str = "decode",
                 tracing: Tracing | None = None, model_path: str = "",
                 runner: str = "generate", timeout_s: float = 600.0):
        self.engine = engine
        self.role = role
        self.model_name = model_name
        self.model_path = model_path
        self.runner = runner
        self.timeout_s = timeout_s  # an Embed's wait
        self.tracing = tracing or Tracing("pdmesh-decode", None)
        self._spans: dict[str, Any] = {}  # request id -> its server span (tracing on)

    async def Session(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        sink = SessionSink()
        live: set[str] = set()
        reader = asyncio.create_task(self._read_session(request_iterator, sink, live))
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
                out = self._outputs(sink.take(), live)
                if out.outputs:
                    yield out
        finally:
            reader.cancel()
            for rid in live:  # the stream ended early: free every running request's blocks
                self.engine.abort(rid)
                self._end_span(rid, None)

    def _outputs(self, deltas: list[TokenDelta], live: set[str]) -> decode_pb2.SessionOutputs:
        out = decode_pb2.SessionOutputs()
        for delta in deltas:
            rid = delta.request_id
            if rid not in live:
                continue  # aborted by the client; nothing more to tell it
            item = out.outputs.add(request_id=rid)
            if delta.error is not None:
                item.error_code = grpc_code(delta.error.status).value[0]
                item.error_message = delta.error.message
            else:
                fill_chunk(item.chunk, delta)
            if delta.finished:
                live.discard(rid)
                self._end_span(rid, delta)
        return out

    async def _read_session(self, requests, sink: SessionSink, live: set[str]) -> None:
        async for msg in requests:
            if msg.HasField("generate"):
                req = msg.generate
                live.add(req.request_id)
                self._begin_span(req, req.trace_context)
                try:
                    submit = submit_from_proto(req, req.request_id)
                except ValueError as e:  # the client's fault: its only output says so
                    sink.push(refused(req.request_id, e))
                    continue
                self.engine.submit(submit, sink)
            elif msg.abort_request_id:
                if msg.abort_request_id in live:
                    live.discard(msg.abort_request_id)
                    self.engine.abort(msg.abort_request_id)

    async def Embed(self, request, context):  # noqa: N802
        return await embed(self.engine, request, context, self.timeout_s)

    async def LoraAdapter(self, request, context):  # noqa: N802
        return await lora_adapter(self.engine, request, context)

    async def Health(self, request, context):  # noqa: N802
        await self.engine.refresh(timeout_s=1.0)  # a hung step: the last load, aged
        return common_pb2.HealthResponse(serving=not self.engine.draining, role=self.role,
                                         model=self.model_name, model_path=self.model_path,
                                         load=load_to_proto(self.engine.load()),
                                         runner=self.runner,
                                         lora_adapters=self.engine.load().lora_adapters)

    # -- tracing -------------------------------------------------------------------------
    def _begin_span(self, request: decode_pb2.GenerateRequest, carrier) -> None:
        if self.tracing.enabled:
            self._spans[request.request_id] = self.tracing.start(
                self.role, self.tracing.extract(carrier), kind="server", attributes={
                    "pdmesh.request_id": request.request_id,
                    "pdmesh.prompt_tokens": len(request.prompt_token_ids),
                    "pdmesh.carried_tokens": len(request.output_token_ids)})

    def _end_span(self, rid: str, delta: TokenDelta | None) -> None:
        span = self._spans.pop(rid, None) if self._spans else None
        if span is None:
            return
        if delta is not None and delta.timing:
            t = delta.timing
            if t["kv_get"]:
                self.tracing.record("kv.get", span, *t["kv_get"],
                                    attributes={"pdmesh.bytes": t.get("kv_get_bytes", 0)})
            self.tracing.record("queue", span, t["arrival"], t["scheduled"])
            self.tracing.record("first_token", span, t["scheduled"], t["first_token"])
            span.set_attribute("pdmesh.finish_reason", delta.finish_reason or "")
        if delta is not None and delta.error is not None:
            span.set_attribute("pdmesh.error", delta.error.message)
        span.end()
