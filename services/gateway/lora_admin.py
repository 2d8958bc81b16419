"""vLLM's runtime LoRA endpoints, over the whole mesh (behind the API key, as every
path but /health and /ping):

    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}: every engine instance reads
                                  and checks the adapter; then the mesh serves it
    POST /v1/unload_lora_adapter  {"lora_name"}: the mesh stops serving it at once (a new
                                  request for it is a 404), and every instance drops it
                                  once the requests already running it are done

The adapters served live in the registry (``Registry.put_adapter``), so every gateway
serves the same ones; an instance that starts later, or dropped an adapter from memory,
reads it from its folder when a request for it arrives. Answers as vLLM's: a plain-text
200, or its errors (400: already loaded, or the adapter cannot run - the instance's
reason, naming what; 404: unloading an adapter not served).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict

from pdmesh.services.gateway.errors import CallFailed, error
from pdmesh.shared.infra.registry import Instance
from pdmesh.shared.proto import common_pb2

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "mixed")
LORA_TIMEOUT_S = 180.0  # an instance reads the adapter between two of its steps


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    lora_name: str = ""
    lora_int_id: int | None = None


def add_lora_routes(app: FastAPI, gw: Any) -> None:
    """The two routes onto ``app``, over ``gw`` (app.Gateway: its router, clients and
    the model names an adapter may not take)."""

    async def load(body: LoadLoraAdapterRequest) -> Any:
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            return error(400, "Both 'lora_name' and 'lora_path' must be provided.",
                         "lora_path" if name else "lora_name")
        if body.load_inplace:
            log.warning("load_lora_adapter: load_inplace is without effect here (an "
                        "adapter is replaced by unloading it, then loading it)")
        if name in gw.names or name in gw.adapters():
            return error(400, f"The lora adapter '{name}' has already been loaded.",
                         "lora_name")
        refused = await _load_everywhere(gw, name, path)
        if refused is not None:
            return refused
        if not gw.state.router.serve_adapter(name, path):  # (another gateway, meanwhile)
            return error(400, f"The lora adapter '{name}' has already been loaded.",
                         "lora_name")
        log.info("LoRA adapter %s (%s) loaded", name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(body: UnloadLoraAdapterRequest) -> Any:
        name = body.lora_name
        if not name:
            return error(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                         "lora_name")
        if not gw.state.router.unserve_adapter(name):
            return error(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        request = common_pb2.LoraAdapterRequest(lora_name=name, unload=True)
        for inst, failed in await _each_instance(gw, request):
            if failed is not None and failed.code != grpc.StatusCode.NOT_FOUND:
                log.warning("unloading LoRA adapter %s on %s: %s", name, inst.id,
                            failed.details or failed.code.name)
        log.info("LoRA adapter %s unloaded", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    app.post("/v1/load_lora_adapter")(load)
    app.post("/v1/unload_lora_adapter")(unload)


async def _load_everywhere(gw: Any, name: str, path: str) -> JSONResponse | None:
    """Load on every engine instance; the error to answer when one cannot run it
    (those that loaded it drop it again) or none answered."""
    results = await _each_instance(gw, common_pb2.LoraAdapterRequest(lora_name=name,
                                                                     lora_path=path))
    bad = [f for _, f in results if f is not None and f.code not in RETRY_ELSEWHERE]
    if results and not bad and any(f is None for _, f in results):
        return None
    loaded = [inst for inst, f in results if f is None]
    if loaded:  # undo
        request = common_pb2.LoraAdapterRequest(lora_name=name, unload=True)
        await asyncio.gather(*(_call(gw, inst, request) for inst in loaded))
    if bad:
        return error(400, bad[0].details or bad[0].code.name, "lora_path")
    why = "; ".join(f"{i.id}: {f.details or f.code.name}" for i, f in results if f)
    return error(503, "no engine instance could load the adapter"
                      + (f" ({why})" if why else " (none is serving)"))


# an instance that is going away or busy did not judge the adapter: it reads it when a
# request for it arrives
RETRY_ELSEWHERE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.CANCELLED})


async def _each_instance(gw: Any, request: common_pb2.LoraAdapterRequest
                         ) -> list[tuple[Instance, CallFailed | None]]:
    """The call on every generating engine instance at once: (instance, its failure)."""
    router = gw.state.router
    instances = [i for role in ROLES for i in router.instances(role)]
    failures = await asyncio.gather(*(_call(gw, inst, request) for inst in instances))
    return list(zip(instances, failures, strict=True))


async def _call(gw: Any, inst: Instance, request: common_pb2.LoraAdapterRequest
                ) -> CallFailed | None:
    try:
        await gw.clients.lora_adapter(inst, request, LORA_TIMEOUT_S)
    except CallFailed as e:
        return e
    return None
