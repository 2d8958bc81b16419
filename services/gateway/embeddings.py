"""POST /v1/embeddings, in OpenAI's (and vLLM's) shapes, from pooling instances (started
with --runner pooling, SGLang's --is-embedding: shared/engine/pooling.py).

    input      a text, a list of texts, a list of token ids, or a list of those
    dimensions a Matryoshka model's shorter embedding (refused by other models)
    use_activation  vLLM 0.32's: normalize or not, over the model's own (its
               sentence-transformers Normalize); vLLM's removed ``normalize`` is a 400
    encoding_format  float, or base64 of ``embed_dtype`` (float32, float16 or bfloat16)
               values in ``endianness`` order (native, little or big)
    truncate_prompt_tokens  the last k tokens (-1: as many as max_model_len holds)

Checked beside vLLM-CPU 0.32's pooling runner on the same checkpoint: the same vectors
within float32 rounding (docs/api.md).

Each input is one ``Embed`` call to a pooling prefill instance (else a pooling mixed one),
the inputs at once; one that refuses at its queue limit or goes away is replaced by
another. A model whose instances all generate answers 400, as vLLM does for a model
without the Embeddings API.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any, Literal

import grpc
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdmesh.services.gateway.errors import CallFailed, MeshError, error, gave_up, http_status
from pdmesh.services.gateway.protocol import Int32, TokenId, warn_once
from pdmesh.shared.infra.registry import Instance
from pdmesh.shared.proto import common_pb2

ROLES = ("prefill", "mixed")  # where embeddings are computed, in the order tried
RETRIED = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=2**31 - 1)
    user: str | None = None
    # vLLM's extensions
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    add_special_tokens: bool = True
    use_activation: bool | None = None
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    endianness: Literal["native", "little", "big"] = "native"
    priority: Int32 | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_normalize(cls, data: Any) -> Any:
        if isinstance(data, dict) and "normalize" in data:  # (vLLM 0.32's 400)
            raise ValueError("normalize: was removed; use use_activation instead")
        return data

    def inputs(self) -> list[str | list[int]]:
        given = self.input
        if isinstance(given, str) or (given and all(isinstance(t, int) for t in given)):
            return [given]  # type: ignore[list-item]
        return list(given)  # type: ignore[arg-type]


def add_route(app: Any, gw: Any) -> None:
    """POST /v1/embeddings onto ``app``, answered from ``gw`` (app.Gateway)."""

    async def embeddings(body: EmbeddingRequest) -> Any:
        if body.model is not None and body.model not in gw.names:
            return gw.refuse_model(body.model)
        if body.model_extra:
            warn_once(list(body.model_extra), "not known here, ignored")
        prompts = await _prompts(gw, body)
        if isinstance(prompts, JSONResponse):
            return prompts
        refused = _refuse_generating(gw.state.router)
        if refused is not None:
            return refused
        failed: MeshError | None = None
        try:  # (one input failing cancels the others' calls: their instances abort them)
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(_embed(gw, body, p)) for p in prompts]
        except* MeshError as e:
            failed = e.exceptions[0]  # type: ignore[assignment]
        if failed is not None:  # (a refusal's message names its field first)
            return error(failed.status, str(failed), str(failed).split(":", 1)[0]
                         if failed.status == 400 else None)
        return _response(gw, body, [t.result() for t in tasks])

    app.post("/v1/embeddings")(embeddings)


async def _prompts(gw: Any, body: EmbeddingRequest) -> list[list[int]] | JSONResponse:
    """Each input as token ids, cut as truncate_prompt_tokens asks; a 400 naming
    ``input`` for an empty one, a token outside the vocabulary or one too long."""
    given = body.inputs()
    if not given:
        return error(400, "input: must not be empty", "input")
    context = gw.context_len()
    out = []
    for one in given:
        if isinstance(one, str):
            prompt = await gw._tokenize(one, "input", body.add_special_tokens)
            if isinstance(prompt, JSONResponse):
                return prompt
        else:
            prompt = list(one)
            bad = next((t for t in prompt if t >= gw.vocab_size), None)
            if bad is not None:
                return error(400, f"input: token id {bad} is outside the vocabulary "
                                  f"[0, {gw.vocab_size})", "input")
        keep = body.truncate_prompt_tokens
        if keep:
            prompt = prompt[-(context if keep == -1 else keep):]
        if not prompt:
            return error(400, "input: must contain at least one token", "input")
        if len(prompt) > context:
            return error(400, f"input: {len(prompt)} tokens are more than max_model_len "
                              f"({context}); truncate_prompt_tokens cuts it", "input")
        out.append(prompt)
    return out


def _refuse_generating(router: Any) -> JSONResponse | None:
    """vLLM's 400 for a model served without the pooling runner."""
    if any(router.instances(r, runner="pooling") for r in ROLES):
        return None
    if any(router.instances(r) for r in ("prefill", "decode", "mixed")):
        return error(400, "model: does not support the Embeddings API (its instances "
                          "generate; start one with --runner pooling, SGLang's "
                          "--is-embedding)", "model")
    return error(503, "no embedding instance is available")


async def _embed(gw: Any, body: EmbeddingRequest, prompt: list[int]
                 ) -> common_pb2.EmbedResponse:
    """One input's embedding; an instance that cannot take it is replaced."""
    mesh, tried, codes = gw.mesh, set(), []
    request = common_pb2.EmbedRequest(
        request_id=f"embd-{uuid.uuid4().hex}", prompt_token_ids=prompt,
        dimensions=body.dimensions, normalize=body.use_activation, priority=body.priority)
    last = "no embedding instance is available"
    for _ in range(mesh.retry.prefill_attempts):
        inst = _pick(mesh.router, tried, prompt)
        if inst is None:
            break
        try:
            return await gw.clients.embed(inst, request, mesh.retry.timeout_s)
        except CallFailed as e:
            if e.code not in RETRIED:
                raise MeshError(e.details or e.code.name, http_status(e.code)) from e
            tried.add(inst.id)
            codes.append(e.code)
            last = e.details or e.code.name
    raise gave_up("pooling", codes, last)


def _pick(router: Any, tried: set[str], prompt: list[int]) -> Instance | None:
    for role in ROLES:
        inst = router.pick(role, exclude=tried, prompt=prompt, runner="pooling")
        if inst is not None:
            return inst
    return None


def _response(gw: Any, body: EmbeddingRequest, answers: list[common_pb2.EmbedResponse]
              ) -> dict[str, Any]:
    data = []
    for i, a in enumerate(answers):
        vec: Any = list(a.embedding)
        if body.encoding_format == "base64":
            vec = base64.b64encode(_encoded(vec, body.embed_dtype, body.endianness)).decode()
        data.append({"index": i, "object": "embedding", "embedding": vec})
    tokens = sum(a.num_prompt_tokens for a in answers)
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": body.model or gw.names[0], "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None,
                      "completion_tokens_details": None}}


def _encoded(vec: list[float], dtype: str, endianness: str) -> bytes:
    """The vector's bytes as vLLM writes them for base64: ``dtype`` values, in
    ``endianness`` order (native: this machine's)."""
    import numpy as np

    order = {"native": "=", "little": "<", "big": ">"}[endianness]
    if dtype == "bfloat16":  # (numpy has none: float32's upper half, rounded to nearest
        bits = np.asarray(vec, dtype=np.float32).view(np.uint32).astype(np.uint64)  # even)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return rounded.astype(order + "u2").tobytes()
    return np.asarray(vec, dtype=order + {"float32": "f4", "float16": "f2"}[dtype]).tobytes()
