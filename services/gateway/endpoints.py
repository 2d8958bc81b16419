"""The vLLM server's smaller endpoints, in its shapes:

    GET  /v1/models/{id}   one model card (404 in OpenAI's error shape for another id)
    GET  /version          {"version"}
    GET|POST /ping         as /health (SageMaker's probe)
    GET  /load             {"server_load": generation requests in flight here}
    POST /tokenize         a prompt, or chat messages through the chat template, as tokens
    POST /detokenize       tokens as text
    POST /v1/responses     OpenAI's Responses API, over the chat path (responses.py)
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

import pdmesh
from pdmesh.services.gateway.errors import error
from pdmesh.services.gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    TokenId,
    ToolSpec,
    render_chat,
)
from pdmesh.services.gateway.responses import ResponsesRequest, events, response, to_chat


class TokenizeRequest(BaseModel):
    """vLLM's: ``prompt``, or ``messages`` with the chat fields."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for chats
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ToolSpec] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[TokenId]


def add_routes(app: FastAPI, gw: Any) -> None:
    """The routes onto ``app``, answered from ``gw`` (app.Gateway: its models, names,
    tokenizer, context length and in-flight count)."""
    async def model_card(model_id: str) -> Any:
        cards = [c for c in (await gw.models())["data"] if c["id"] == model_id]
        if not cards:
            return gw.refuse_model(model_id)
        return cards[0]

    async def version() -> dict[str, str]:
        return {"version": pdmesh.__version__}

    async def load() -> dict[str, int]:
        return {"server_load": gw.in_flight.count}

    async def tokenize(body: TokenizeRequest) -> Any:
        refused = _check(gw, body.model)
        if refused is not None:
            return refused
        try:
            tokens = await asyncio.to_thread(_tokens, gw, body)
        except ValueError as e:
            return error(400, str(e), str(e).split(":", 1)[0])
        strs = ([gw.state.tokenizer.id_to_token(t) for t in tokens]
                if body.return_token_strs else None)
        return {"count": len(tokens), "max_model_len": gw.context_len(), "tokens": tokens,
                "token_strs": strs}

    async def detokenize(body: DetokenizeRequest) -> Any:
        refused = _check(gw, body.model)
        if refused is not None:
            return refused
        bad = next((t for t in body.tokens if t >= gw.vocab_size), None)
        if bad is not None:
            return error(400, f"tokens: token id {bad} is outside the vocabulary "
                                 f"[0, {gw.vocab_size})", "tokens")
        return {"prompt": gw.state.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    app.post("/v1/responses")(_responses(gw))
    app.get("/v1/models/{model_id:path}")(model_card)
    app.get("/version")(version)
    app.get("/ping")(gw.health)
    app.post("/ping")(gw.health)
    app.get("/load")(load)
    app.post("/tokenize")(tokenize)
    app.post("/detokenize")(detokenize)


def _responses(gw: Any) -> Any:
    """POST /v1/responses: the request read into a chat completion, served by ``gw``'s
    chat route, its answer written back as a Response (responses.py)."""

    async def responses(body: ResponsesRequest, request: Request) -> Any:
        try:
            chat = to_chat(body)
            if body.stream:
                chat["stream_options"] = {"include_usage": True}
            chat_body = ChatCompletionRequest.model_validate(chat)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "input"
            return error(400, f"{where}: {err['msg']}", where)
        except ValueError as e:
            return error(400, str(e), str(e).split(":", 1)[0])
        answer = await gw.chat(chat_body, request)
        if answer.status_code != 200:
            return answer
        if not body.stream:
            return response(json.loads(answer.body), body)
        return StreamingResponse(events(answer.body_iterator, body),
                                 media_type="text/event-stream")

    return responses


def _check(gw: Any, model: str | None) -> JSONResponse | None:
    """A named model must be served here, or a LoRA adapter on it (its tokenizer is
    the model's); none named: the served one."""
    if model is None or model in gw.names or model in gw.adapters():
        return None
    return gw.refuse_model(model)


def _tokens(gw: Any, body: TokenizeRequest) -> list[int]:
    """The tokens, at most the context's (``max_model_len``): a longer text is a
    ValueError naming its field, told by its length before tokenizing where it can be."""
    tok = gw.state.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise ValueError("prompt: give a prompt or messages (one of them)")
    field = "prompt" if body.prompt is not None else "messages"
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        text = body.prompt
    else:
        text = render_chat(tok, body, gw.state.trust_request_chat_template)
        special = bool(body.add_special_tokens)
    context = gw.context_len()
    if gw.max_text_chars is not None and len(text) > gw.max_text_chars:
        raise ValueError(f"{field}: {len(text)} characters are more than max_model_len "
                         f"({context}) tokens can hold")
    tokens = tok.encode(text, special)
    if len(tokens) > context:
        raise ValueError(f"{field}: {len(tokens)} tokens are more than max_model_len "
                         f"({context})")
    return tokens
