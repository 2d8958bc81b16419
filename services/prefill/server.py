"""Prefill's gRPC edge (grpc.aio, in the edge process: shared.runtime.edge). A request's
life here:

    Prefill(prompt) -> the engine admits it (prompt blocks already in the pool are
    loaded, not computed) or refuses it -> chunked prefill -> first token sampled ->
    answer {first token, cached tokens} -> prompt blocks (full ones and the partial
    tail) put in the pool -> answer {keys, finish reason}.

A refusal answers with its status (INVALID_ARGUMENT; RESOURCE_EXHAUSTED at
--max-queued-requests, and the gateway tries another instance; UNAVAILABLE while
draining). A caller that goes away aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import Any

import grpc

from pdmesh.shared.infra.tracing import Tracing
from pdmesh.shared.proto import common_pb2, prefill_pb2, prefill_pb2_grpc
from pdmesh.shared.runtime.client import EngineClient, RequestStream
from pdmesh.shared.runtime.embed_edge import embed
from pdmesh.shared.runtime.lora_edge import lora_adapter
from pdmesh.shared.runtime.proto_convert import (
    grpc_code,
    load_to_proto,
    logprobs_to_proto,
    prompt_logprobs_to_proto,
    submit_from_proto,
)
from pdmesh.shared.runtime.protocol import InvalidRequest, TokenDelta

log = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine: EngineClient, model_name: str, timeout_s: float = 600.0,
                 tracing: Tracing | None = None, model_path: str = "",
                 runner: str = "generate"):
        self.engine = engine
        self.tracing = tracing or Tracing("pdmesh-prefill", None)
        self.model_name = model_name
        self.model_path = model_path
        self.timeout_s = timeout_s
        self.runner = runner

    async def Prefill(self, request, context):  # noqa: N802 (gRPC method name)
        span = None
        if self.tracing.enabled:
            parent = self.tracing.extract(dict(context.invocation_metadata()))
            span = self.tracing.start("prefill", parent, kind="server", attributes={
                "pdmesh.request_id": request.request_id,
                "pdmesh.prompt_tokens": len(request.prompt_token_ids)})
        try:
            rid, stream = await self._submit(request, context)
            delta = await self._next(rid, stream, context)
            if not delta.finished:  # the first token, its prompt's put still under way
                yield self._first(request, delta)
                delta = await self._next(rid, stream, context)
                yield self._stored(request, delta)
            else:  # both at once
                resp = self._first(request, delta)
                resp.MergeFrom(self._stored(request, delta))
                yield resp
            if span is not None:
                self._record(span, delta)
        finally:
            if span is not None:
                span.end()

    async def _submit(self, request, context) -> tuple[str, RequestStream]:
        """This instance produces one token only (after any the request carries, when a
        decode instance handed it back); decode does the rest."""
        rid = request.request_id or f"prefill-{uuid.uuid4().hex}"
        try:
            submit = submit_from_proto(request, rid)
        except ValueError as e:
            await context.abort(grpc_code(InvalidRequest.status), str(e))
        budget = len(submit.output_token_ids) + 1  # min_tokens past it is decode's to keep
        submit.sampling = dataclasses.replace(
            submit.sampling, max_tokens=budget,
            min_tokens=min(submit.sampling.min_tokens, budget))
        stream = RequestStream()
        self.engine.submit(submit, stream)
        return rid, stream

    async def _next(self, rid: str, stream: RequestStream, context) -> TokenDelta:
        """The request's next delta: its first token, then (or with it) the end of its
        prompt's put."""
        try:  # (not wait_for: Python 3.11's loses a cancel that comes as the delta does)
            async with asyncio.timeout(self.timeout_s):
                delta = await stream.next()
        except (asyncio.CancelledError, TimeoutError):
            self.engine.abort(rid)  # the caller left or gave up
            raise
        if delta.error is not None:
            await context.abort(grpc_code(delta.error.status), delta.error.message)
        if delta.finish_reason == "abort":
            await context.abort(grpc.StatusCode.CANCELLED,
                                f"request {rid} aborted")
        return delta

    @staticmethod
    def _first(request, delta: TokenDelta) -> prefill_pb2.PrefillResponse:
        resp = prefill_pb2.PrefillResponse(
            first_token=delta.token_ids[0], num_cached_tokens=delta.num_cached_tokens,
            num_prompt_tokens=len(request.prompt_token_ids))
        if delta.logprobs:
            resp.first_logprobs.CopyFrom(logprobs_to_proto(delta.logprobs[0]))
        resp.prompt_logprobs.extend(prompt_logprobs_to_proto(delta.prompt_logprobs))
        return resp

    def _stored(self, request, delta: TokenDelta) -> prefill_pb2.PrefillResponse:
        # the token ends the request by itself when it is a stop token, the caller asked
        # for no more, or the context is full; "error": its grammar refused it
        carried = len(request.output_token_ids)
        total = len(request.prompt_token_ids) + carried + 1
        finish = delta.finish_reason if delta.finish_reason in ("stop", "error") else (
            "length" if request.sampling.max_tokens == carried + 1
            or total >= self.engine.max_model_len else "")
        return prefill_pb2.PrefillResponse(block_keys=delta.kv_keys, finish_reason=finish,
                                           kv_stored=True)

    def _record(self, span: Any, delta: TokenDelta) -> None:
        if not delta.timing:
            return
        t = delta.timing
        span.set_attribute("pdmesh.cached_tokens", delta.num_cached_tokens)
        self.tracing.record("queue", span, t["arrival"], t["scheduled"])
        self.tracing.record("compute", span, t["scheduled"], t["first_token"])
        if t["kv_get"]:
            self.tracing.record("kv.get", span, *t["kv_get"],
                                attributes={"pdmesh.bytes": t.get("kv_get_bytes", 0)})
        if t["kv_put"]:
            self.tracing.record("kv.put", span, *t["kv_put"],
                                attributes={"pdmesh.blocks": len(delta.kv_keys),
                                            "pdmesh.bytes": t.get("kv_put_bytes", 0)})

    async def Embed(self, request, context):  # noqa: N802
        return await embed(self.engine, request, context, self.timeout_s)

    async def LoraAdapter(self, request, context):  # noqa: N802
        return await lora_adapter(self.engine, request, context)

    async def Health(self, request, context):  # noqa: N802
        await self.engine.refresh(timeout_s=1.0)  # a hung step: the last load, aged
        return common_pb2.HealthResponse(serving=not self.engine.draining, role="prefill",
                                         model=self.model_name, model_path=self.model_path,
                                         load=load_to_proto(self.engine.load()),
                                         runner=self.runner,
                                         lora_adapters=self.engine.load().lora_adapters)
