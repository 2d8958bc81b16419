"""The ``LoraAdapter`` call on an instance's gRPC edge (prefill, mixed and decode alike):
vLLM's load_lora_adapter / unload_lora_adapter on this instance's engine, done between
two of its steps. A load reads and checks the adapter now (INVALID_ARGUMENT with what
does not fit, the folder or a module named); an unload of an adapter not loaded here is
NOT_FOUND; requests already running an unloaded adapter finish with it."""

from __future__ import annotations

from pdmesh.shared.proto import common_pb2
from pdmesh.shared.runtime.client import EngineClient
from pdmesh.shared.runtime.proto_convert import grpc_code
from pdmesh.shared.runtime.protocol import LoraCommand, Status

# reading an adapter is a few file reads, between two steps; a step may take seconds
LORA_TIMEOUT_S = 120.0


async def lora_adapter(engine: EngineClient, request: common_pb2.LoraAdapterRequest,
                       context) -> common_pb2.LoraAdapterResponse:
    if not request.lora_name:
        await context.abort(grpc_code(Status.INVALID_ARGUMENT), "lora_name: must not be empty")
    if not request.unload and not request.lora_path:
        await context.abort(grpc_code(Status.INVALID_ARGUMENT), "lora_path: must not be empty")
    answer = await engine.lora(LoraCommand("", request.lora_name, request.lora_path,
                                           request.unload), LORA_TIMEOUT_S)
    if answer.error is not None:
        await context.abort(grpc_code(answer.error.status), answer.error.message)
    return common_pb2.LoraAdapterResponse()

