"""Decode's gRPC edge (grpc.aio: one event-loop thread serves every stream while the
engine steps in the main thread). Lifecycle of a request here:

    Generate(prompt, tokens so far, pool keys) -> engine loop: admitted (the prompt's
    blocks pulled from the pool into the paged cache; anything missing is recomputed)
    -> joins the continuous batch -> tokens streamed as they come (tokens that queued
    up while the reader was busy go out in one chunk) -> the last chunk carries
    finish_reason. Cancelling the stream aborts the request and frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.prefill.server import load_proto
from shared.engine.loop import AsyncRequestStream, EngineLoop
from shared.proto import common_pb2, decode_pb2, decode_pb2_grpc
from shared.proto.convert import logprobs_to_proto, sampling_from_proto

log = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, loop: EngineLoop, model_name: str, idle_timeout_s: float = 600.0,
                 role: str = "decode"):
        self.loop = loop
        self.role = role
        self.model_name = model_name
        self.idle_timeout_s = idle_timeout_s

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        try:
            params = sampling_from_proto(request.sampling)
            stream = self.loop.submit(list(request.prompt_token_ids), params,
                                      request_id=request.request_id or None,
                                      priority=request.priority,
                                      output_token_ids=list(request.output_token_ids),
                                      aio_loop=asyncio.get_running_loop())
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        assert isinstance(stream, AsyncRequestStream)
        finished = False
        try:
            while not finished:
                event = await asyncio.wait_for(stream.next(), self.idle_timeout_s)
                if event.error:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, event.error)
                chunk = decode_pb2.GenerateChunk(
                    token_ids=event.token_ids,
                    logprobs=[logprobs_to_proto(lp) for lp in event.logprobs],
                    finish_reason=event.finish_reason or "",
                    num_cached_tokens=event.num_cached_tokens)
                if event.stop_reason is not None:
                    chunk.stop_reason = event.stop_reason
                finished = event.finished
                yield chunk
        finally:
            if not finished:  # cancelled, timed out or failed: free the request's blocks
                self.loop.abort(stream.request_id)

    async def Health(self, request, context):  # noqa: N802
        return common_pb2.HealthResponse(serving=True, role=self.role, model=self.model_name,
                                         load=load_proto(self.loop))
