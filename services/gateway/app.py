"""The gateway's HTTP edge: the OpenAI API over the PD mesh.

    POST /v1/completions, /v1/chat/completions  (SSE when "stream": true)
    GET  /v1/models, /health, /metrics

A request: validated and tokenized here -> a ``Journey`` through the mesh (journey.py)
-> its TokenDeltas written as the OpenAI answer (answer.py). Every failure answers in
OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``: 400 naming the
field for a malformed request, 401 without the API key, 404 for an unknown model, 429
with ``Retry-After`` when the gateway already has ``--max-queued-requests`` requests in
flight or every instance refused the request at its own queue limit, 503 when the mesh
cannot serve. Never a 200 with an empty body: a failure after a stream has started is
sent as an error event before ``[DONE]``.
"""

from __future__ import annotations

import hmac
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdmesh.services.gateway.answer import Answer
from pdmesh.services.gateway.clients import GrpcClients
from pdmesh.services.gateway.errors import MeshError, error_type
from pdmesh.services.gateway.journey import Journey, JourneyTrace, Mesh, MeshRequest
from pdmesh.services.gateway.metrics import GatewayMetrics
from pdmesh.services.gateway.protocol import ChatCompletionRequest, CompletionRequest, _Base
from pdmesh.services.gateway.router import Router
from pdmesh.shared.infra.tracing import Tracing
from pdmesh.shared.models.tokenizer import Tokenizer

RETRY_AFTER_S = 1  # what a 429 tells the client to wait


@dataclass
class GatewayState:
    tokenizer: Tokenizer
    router: Router
    model_name: str  # the name instances register under
    max_model_len: int
    model_names: tuple[str, ...] = ()  # every name clients may ask for (--served-model-name)
    api_key: str | None = None
    max_queued_requests: int | None = None  # requests in flight here; None: no limit
    tracing: Tracing | None = None  # None or disabled: no traces, no cost
    log_requests: int | None = None  # --log-requests-level when --log-requests; else None


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return JSONResponse(status_code=status, headers=headers, content={"error": {
        "message": message, "type": error_type(status), "param": param, "code": status}})


class Gateway:
    """The routes, over one mesh (router, gRPC clients, metrics)."""

    def __init__(self, state: GatewayState):
        self.state = state
        self.clients = GrpcClients()
        self.metrics = GatewayMetrics(state.model_name, state.router)
        self.mesh = Mesh(state.router, self.clients, self.clients, events=self.metrics)
        self.tracing = state.tracing or Tracing("pdmesh-gateway", None)

    async def health(self) -> JSONResponse:
        router = self.state.router
        n_pre, n_dec, n_mix = (len(router.instances(r)) for r in ("prefill", "decode", "mixed"))
        ok = (n_pre > 0 and n_dec > 0) or n_mix > 0
        return JSONResponse(status_code=200 if ok else 503,
                            content={"status": "ok" if ok else "unavailable",
                                     "prefill": n_pre, "decode": n_dec, "mixed": n_mix})

    async def prometheus(self) -> Response:
        return PlainTextResponse(generate_latest(self.metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "pdmesh",
            "max_model_len": self.state.max_model_len} for name in self.names]}

    @property
    def names(self) -> tuple[str, ...]:
        return self.state.model_names or (self.state.model_name,)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        prompt = _completion_prompt(body, self.state.tokenizer)
        if isinstance(prompt, JSONResponse):
            return prompt
        return await self.serve(body, prompt, False, request.headers)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        tok = self.state.tokenizer
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tok.apply_chat_template(messages,
                                           add_generation_prompt=body.add_generation_prompt)
        except ValueError as e:
            return error(400, str(e), "messages")
        return await self.serve(body, tok.encode(text, add_special_tokens=False), True,
                                request.headers)

    async def serve(self, body: _Base, prompt: list[int], chat: bool, headers: Any
                    ) -> Response:
        state = self.state
        if body.model not in self.names:
            return error(404, f"model: {body.model!r} is not served here (serving "
                              f"{', '.join(repr(n) for n in self.names)})", "model")
        if not prompt:
            return error(400, "prompt: must not be empty", "prompt")
        if len(prompt) >= state.max_model_len:
            return error(400, f"prompt: {len(prompt)} tokens leaves no room to generate "
                              f"within max_model_len ({state.max_model_len})", "prompt")
        try:
            params = body.to_sampling(state.max_model_len - len(prompt))
        except ValueError as e:
            return error(400, str(e), str(e).split(":", 1)[0])
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        span = self._span(rid, chat, prompt, body, headers)
        journey = Journey(self.mesh, MeshRequest(rid, prompt, params, body.priority),
                          JourneyTrace(self.tracing, span) if span is not None else None)
        answer = Answer(rid, body.model, chat, prompt, params, body.stop_strings(),
                        state.tokenizer, self.metrics, span, state.log_requests)
        try:  # the first token before any answer: a failure here gets its status code
            await answer.start(journey.run())
            if not body.stream:
                return JSONResponse(await answer.whole())
        except MeshError as e:
            await answer.close()
            (self.metrics.rejected if e.status == 429 else self.metrics.failures).inc()
            return error(e.status, str(e))
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(answer.sse(include_usage), media_type="text/event-stream")

    def _span(self, rid: str, chat: bool, prompt: list[int], body: _Base, headers: Any
              ) -> Any:
        """The request's trace, under the caller's traceparent (None: not tracing)."""
        if not self.tracing.enabled:
            return None
        return self.tracing.start(f"POST /v1/{'chat/' if chat else ''}completions",
                                  self.tracing.extract(dict(headers or {})), kind="server",
                                  attributes={"pdmesh.request_id": rid,
                                              "pdmesh.prompt_tokens": len(prompt),
                                              "pdmesh.stream": bool(body.stream)})


def create_app(state: GatewayState) -> FastAPI:
    app = FastAPI(title="pdmesh gateway")
    gw = Gateway(state)
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    if state.max_queued_requests is not None:
        app.add_middleware(_InFlightLimit, limit=state.max_queued_requests,
                           rejected=gw.metrics.rejected)
    if state.api_key:  # added last: runs first, so a refused key takes no slot
        app.add_middleware(_ApiKey, key=state.api_key)
    app.router.on_shutdown.append(gw.clients.close)
    app.get("/health")(gw.health)
    app.get("/metrics")(gw.prometheus)
    app.get("/v1/models")(gw.models)
    app.post("/v1/completions")(gw.completions)
    app.post("/v1/chat/completions")(gw.chat)
    return app


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = ".".join(loc) or None
    return error(400, f"{field or 'body'}: {first.get('msg', 'invalid request')}", field)


class _ApiKey:
    """``Authorization: Bearer KEY`` on /v1/ paths. A plain ASGI middleware: Starlette's
    BaseHTTPMiddleware would pass every streamed chunk through an extra task and queue."""

    def __init__(self, app: Any, key: str):
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization")
            if given is None or not hmac.compare_digest(given, self.expected):
                response = error(401, "missing or wrong API key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _InFlightLimit:
    """At most ``limit`` generation requests in flight (from arrival until the last byte
    of the answer, streamed or not); one more is answered 429 with Retry-After at once,
    never queued. A plain ASGI middleware, so the slot is given back however the request
    ends (finished, failed, or the client went away)."""

    PATHS = ("/v1/completions", "/v1/chat/completions")

    def __init__(self, app: Any, limit: int, rejected: Any = None):
        self.app = app
        self.limit = limit
        self.rejected = rejected  # a counter
        self.in_flight = 0  # the event loop's thread only

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in self.PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            if self.rejected is not None:
                self.rejected.inc()
            response = error(429, f"the gateway has {self.in_flight} requests in flight, its "
                                  f"--max-queued-requests limit; retry after "
                                  f"{RETRY_AFTER_S} s")
            await response(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def _completion_prompt(body: CompletionRequest, tok: Tokenizer) -> list[int] | JSONResponse:
    p = body.prompt
    if isinstance(p, str):
        return tok.encode(p)
    if p and all(isinstance(t, int) for t in p):
        return list(p)  # type: ignore[arg-type]
    if isinstance(p, list) and len(p) == 1:
        one = p[0]
        return tok.encode(one) if isinstance(one, str) else list(one)  # type: ignore[arg-type]
    return error(400, "prompt: one prompt per request (a string or a list of token ids)",
                 "prompt")
