"""The ``Embed`` call on an instance's gRPC edge (prefill, mixed and decode alike): one
prompt in, its embedding out, from an engine started with the pooling runner. A
generating engine refuses it (INVALID_ARGUMENT, naming --runner pooling); a caller that
goes away or waits past the timeout aborts it and frees its blocks."""

from __future__ import annotations

import asyncio
import uuid

import grpc

from pdmesh.shared.engine.pooling import PoolingParams
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.proto import common_pb2
from pdmesh.shared.runtime.client import EngineClient, RequestStream
from pdmesh.shared.runtime.proto_convert import grpc_code
from pdmesh.shared.runtime.protocol import SubmitRequest, TokenDelta


async def embed(engine: EngineClient, request: common_pb2.EmbedRequest, context,
                timeout_s: float) -> common_pb2.EmbedResponse:
    rid = request.request_id or f"embed-{uuid.uuid4().hex}"
    params = PoolingParams(
        dimensions=request.dimensions if request.HasField("dimensions") else None,
        use_activation=request.normalize if request.HasField("normalize") else None)
    stream = RequestStream()
    engine.submit(SubmitRequest(rid, list(request.prompt_token_ids),
                                SamplingParams(max_tokens=1),
                                request.priority if request.HasField("priority") else None,
                                pooling=params), stream)
    delta = await _final(engine, rid, stream, timeout_s)
    if delta.error is not None:
        await context.abort(grpc_code(delta.error.status), delta.error.message)
    if delta.finish_reason == "abort":
        await context.abort(grpc.StatusCode.CANCELLED, f"request {rid} aborted")
    if not delta.embedding:
        await context.abort(grpc.StatusCode.INTERNAL,
                            f"request {rid} ended ({delta.finish_reason}) with no embedding")
    return common_pb2.EmbedResponse(embedding=delta.embedding,
                                    num_prompt_tokens=len(request.prompt_token_ids),
                                    num_cached_tokens=delta.num_cached_tokens)


async def _final(engine: EngineClient, rid: str, stream: RequestStream,
                 timeout_s: float) -> TokenDelta:
    try:  # (not wait_for: Python 3.11's loses a cancel that comes as the delta does)
        async with asyncio.timeout(timeout_s):
            delta = await stream.next()
            while not delta.finished:
                delta = await stream.next()
    except (asyncio.CancelledError, TimeoutError):
        engine.abort(rid)  # the caller left or gave up
        raise
    return delta
