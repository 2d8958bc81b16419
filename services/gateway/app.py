"""The gateway's HTTP edge: the OpenAI API over the PD mesh.

    POST /v1/completions, /v1/chat/completions  (SSE when "stream": true)
    GET  /v1/models, /health, /metrics

Every failure answers in OpenAI's error shape, ``{"error": {"message", "type", "param",
"code"}}``: 400 naming the field for a malformed request, 401 without the API key, 404
for an unknown model, 429 with ``Retry-After`` when the gateway already has
``--max-queued-requests`` requests in flight or every instance refused the request at
its own queue limit, 503 when the mesh cannot serve. Never a 200 with an empty body:
a failure after a stream has started is sent as an error event before ``[DONE]``.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

from pdmesh.services.gateway.detokenize import IncrementalText
from pdmesh.services.gateway.pd import Channels, MeshError, Piece, generate
from pdmesh.services.gateway.protocol import ChatCompletionRequest, CompletionRequest, _Base
from pdmesh.services.gateway.router import Router
from pdmesh.shared.engine.request import Logprob
from pdmesh.shared.infra.logs import REQUEST_LOG, request_record
from pdmesh.shared.infra.tracing import Tracing
from pdmesh.shared.models.tokenizer import Tokenizer

Delta = tuple[str, list[tuple[int, dict[int, Logprob]]]]  # new text, (token, logprobs)s


@dataclass
class GatewayState:
    tokenizer: Tokenizer
    router: Router
    model_name: str
    max_model_len: int
    api_key: str | None = None
    max_queued_requests: int | None = None  # requests in flight here; None: no limit
    tracing: Tracing | None = None  # None or disabled: no traces, no cost
    log_requests: int | None = None  # --log-requests-level when --log-requests; else None


_REQUESTS = logging.getLogger(REQUEST_LOG)
_REQUESTS.setLevel(logging.INFO)  # --log-requests shows them whatever --log-level says

RETRY_AFTER_S = 1  # what a 429 tells the client to wait


def error(status: int, message: str, param: str | None = None,
          kind: str = "invalid_request_error") -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return JSONResponse(status_code=status, headers=headers, content={"error": {
        "message": message, "type": kind, "param": param, "code": status}})


class _Metrics:
    """The gateway's /metrics: requests as clients see them (vLLM's names, pdmesh_), what
    the mesh had to do for them, and which instances the router sees."""

    def __init__(self, model: str, router: Router | None = None) -> None:
        from pdmesh.shared.infra.metrics import LATENCY_BUCKETS  # (also turns off _created series)

        self.registry = CollectorRegistry()
        m = {"model_name": model}
        reg = self.registry
        self._success = Counter("pdmesh_request_success", "Finished requests",
                                ["model_name", "finished_reason"], registry=reg)
        self.model = model
        self.prompt_tokens = Counter("pdmesh_prompt_tokens", "Prompt tokens of finished "
                                     "requests", list(m), registry=reg).labels(**m)
        self.generation_tokens = Counter("pdmesh_generation_tokens", "Generated tokens "
                                         "sent to clients", list(m), registry=reg).labels(**m)
        self.failures = Counter("pdmesh_request_failure", "Requests that failed",
                                list(m), registry=reg).labels(**m)
        self.ttft = Histogram("pdmesh_time_to_first_token_seconds", "Arrival to the first "
                              "token", list(m), buckets=LATENCY_BUCKETS,
                              registry=reg).labels(**m)
        self.itl = Histogram("pdmesh_inter_token_latency_seconds", "Between two tokens of "
                             "a response", list(m), buckets=LATENCY_BUCKETS,
                             registry=reg).labels(**m)
        self.e2e = Histogram("pdmesh_e2e_request_latency_seconds", "Arrival to the last "
                             "token", list(m), buckets=LATENCY_BUCKETS,
                             registry=reg).labels(**m)
        self._retries = Counter("pdmesh_gateway_retries", "Calls retried on another "
                                "instance", ["model_name", "role"], registry=reg)
        for role in ("prefill", "decode"):  # exported at 0 from the start
            self._retries.labels(model_name=model, role=role)
        self.migrated = Counter("pdmesh_requests_migrated", "Requests continued on another "
                                "decode instance after theirs failed mid-stream", list(m),
                                registry=reg).labels(**m)
        self.handed_back = Counter("pdmesh_requests_handed_back", "Requests a decode "
                                   "instance handed back (recompute scheduler) and the "
                                   "gateway re-prefilled", list(m), registry=reg).labels(**m)
        self.offloaded = Counter("pdmesh_requests_offloaded", "Requests whose prompt a "
                                 "decode instance computed itself because prefill was "
                                 "backed up (--prefill-offload-threshold)", list(m),
                                 registry=reg).labels(**m)
        self.rejected = Counter("pdmesh_requests_rejected", "Requests answered 429 "
                                "(queue limits)", list(m), registry=reg).labels(**m)
        if router is not None:
            reg.register(_InstancesUp(router, model))  # type: ignore[arg-type]

    def success(self, reason: str) -> None:
        self._success.labels(model_name=self.model, finished_reason=reason).inc()

    # what the mesh path reports (services/gateway/pd.py)
    def retried(self, role: str) -> None:
        self._retries.labels(model_name=self.model, role=role).inc()


class _InstancesUp:
    """pdmesh_instance_up{instance, role, address}: 1 for each instance the router would
    route to (heartbeat fresh, not draining), read when scraped."""

    def __init__(self, router: Router, model: str):
        self.router = router
        self.model = model

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        g = GaugeMetricFamily("pdmesh_instance_up", "Instances the gateway routes to",
                              labels=["model_name", "instance", "role", "address"])
        for role in ("prefill", "decode", "mixed"):
            for inst in self.router.instances(role):
                g.add_metric([self.model, inst.id, role, inst.address], 1)
        yield g


def create_app(state: GatewayState) -> FastAPI:
    app = FastAPI(title="pdmesh gateway")
    channels = Channels()
    metrics = _Metrics(state.model_name, state.router)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        field = ".".join(loc) or None
        return error(400, f"{field or 'body'}: {first.get('msg', 'invalid request')}", field)

    if state.max_queued_requests is not None:
        app.add_middleware(_InFlightLimit, limit=state.max_queued_requests,
                           rejected=metrics.rejected)
    if state.api_key:  # added last: runs first, so a refused key takes no slot
        app.add_middleware(_ApiKey, key=state.api_key)

    @app.on_event("shutdown")
    async def _close() -> None:
        await channels.close()

    @app.get("/health")
    async def health() -> JSONResponse:
        n_pre = len(state.router.instances("prefill"))
        n_dec = len(state.router.instances("decode"))
        n_mix = len(state.router.instances("mixed"))
        ok = (n_pre > 0 and n_dec > 0) or n_mix > 0
        return JSONResponse(status_code=200 if ok else 503,
                            content={"status": "ok" if ok else "unavailable",
                                     "prefill": n_pre, "decode": n_dec, "mixed": n_mix})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(generate_latest(metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": 0, "owned_by": "pdmesh",
            "max_model_len": state.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompt = _completion_prompt(body, state.tokenizer)
        if isinstance(prompt, JSONResponse):
            return prompt
        return await _serve(body, prompt, chat=False, headers=request.headers)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = state.tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt)
        except ValueError as e:
            return error(400, str(e), "messages")
        return await _serve(body, state.tokenizer.encode(text, add_special_tokens=False),
                            chat=True, headers=request.headers)

    tracing = state.tracing or Tracing("pdmesh-gateway", None)

    async def _serve(body: _Base, prompt: list[int], chat: bool, headers: Any = None
                     ) -> Response:
        if body.model != state.model_name:
            return error(404, f"model: {body.model!r} is not served here "
                              f"(serving {state.model_name!r})", "model")
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
        span = None
        if tracing.enabled:  # one trace per request, under the caller's traceparent
            span = tracing.start(f"POST /v1/{'chat/' if chat else ''}completions",
                                 tracing.extract(dict(headers or {})), kind="server",
                                 attributes={"pdmesh.request_id": rid,
                                             "pdmesh.prompt_tokens": len(prompt),
                                             "pdmesh.stream": bool(body.stream)})
        pieces = generate(state.router, channels, rid, prompt, params, body.priority,
                          events=metrics, trace=(tracing, span) if span is not None else None)
        text = IncrementalText(state.tokenizer, body.stop_strings(), params.skip_special_tokens)
        stream = _Stream(rid, state.model_name, chat, prompt, text, state.tokenizer,
                         params.logprobs, metrics, span)
        if state.log_requests is not None:
            stream.log_level, stream.params = state.log_requests, params
        deltas = stream.deltas(pieces)
        try:  # the first token before any answer: a failure here gets its status code
            first = await deltas.__anext__()
            if not body.stream:
                return JSONResponse(await stream.whole(first, deltas))
        except MeshError as e:
            await deltas.aclose()
            if e.status == 429:
                metrics.rejected.inc()
            else:
                metrics.failures.inc()
            return error(e.status, str(e), kind=_error_kind(e.status))
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(stream.sse(first, deltas, include_usage),
                                 media_type="text/event-stream")

    return app


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
                response = error(401, "missing or wrong API key", kind="authentication_error")
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
                                  f"{RETRY_AFTER_S} s", kind="rate_limit_error")
            await response(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def _error_kind(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


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


class _Stream:
    """Turns mesh pieces into OpenAI responses, whole or as SSE chunks."""

    def __init__(self, rid: str, model: str, chat: bool, prompt: list[int],
                 text: IncrementalText, tok: Tokenizer, logprobs: int | None,
                 metrics: _Metrics, span: Any = None):
        self.rid, self.model, self.chat, self.prompt = rid, model, chat, prompt
        self.span = span  # the request's trace span, ended with the answer
        self.log_level: int | None = None  # log the request when it ends (--log-requests)
        self.params: Any = None
        self.ttft: float | None = None
        self.text, self.tok, self.logprobs, self.metrics = text, tok, logprobs, metrics
        self.created = int(time.time())
        self.t0 = time.perf_counter()
        self._last: float | None = None  # when the last token reached us
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None

    async def deltas(self, pieces: AsyncIterator[Piece]
                     ) -> AsyncIterator[Delta]:
        """(new text, [(token, logprobs)]) per piece; stops early on a stop string."""
        try:
            async for piece in pieces:
                if piece.num_cached_tokens is not None:
                    self.cached_tokens = piece.num_cached_tokens
                self.completion_tokens += len(piece.token_ids)
                self._timing(len(piece.token_ids))
                delta = self.text.add(piece.token_ids)
                lps = list(zip(piece.token_ids, piece.logprobs, strict=False))
                if self.text.stopped:
                    self.finish_reason = "stop"
                    yield delta, lps
                    return
                if piece.finish_reason:
                    self.finish_reason = piece.finish_reason
                    delta += self.text.flush()
                yield delta, lps
        finally:
            await pieces.aclose()  # type: ignore[attr-defined]  (cancels the gRPC calls)
            self.metrics.generation_tokens.inc(self.completion_tokens)
            if self.log_level is not None:
                self._log()
            if self.span is not None:
                self.span.set_attribute("pdmesh.completion_tokens", self.completion_tokens)
                self.span.set_attribute("pdmesh.finish_reason", self.finish_reason or "")
                self.span.end()

    def _log(self) -> None:
        level = self.log_level or 0
        rec = request_record(
            level, request_id=self.rid, model=self.model, prompt_tokens=len(self.prompt),
            completion_tokens=self.completion_tokens, finish_reason=self.finish_reason,
            seconds=time.perf_counter() - self.t0, ttft_s=self.ttft, params=self.params,
            prompt_text=self.tok.decode(self.prompt) if level >= 2 else "",
            output_text=self.text.text if level >= 2 else "")
        trace_id = (format(self.span.get_span_context().trace_id, "032x")
                    if self.span is not None else None)
        _REQUESTS.info("request %s finished (%s): %d prompt + %d generated tokens in "
                       "%.3f s", self.rid, self.finish_reason, len(self.prompt),
                       self.completion_tokens, rec["e2e_s"],
                       extra={"request_id": self.rid, "trace_id": trace_id, "request": rec})

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": self.completion_tokens,
                "total_tokens": len(self.prompt) + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def _timing(self, n: int) -> None:
        """TTFT for the first token; for later ones, the wait shared over the tokens
        that arrived together."""
        if not n:
            return
        now = time.perf_counter()
        if self._last is None:
            self.ttft = now - self.t0
            self.metrics.ttft.observe(self.ttft)
            n -= 1
        else:
            gap = (now - self._last) / n
            for _ in range(n):
                self.metrics.itl.observe(gap)
        self._last = now

    def _finished(self) -> None:
        self.metrics.prompt_tokens.inc(len(self.prompt))
        self.metrics.success(self.finish_reason or "stop")
        self.metrics.e2e.observe(time.perf_counter() - self.t0)

    async def whole(self, first: Delta, deltas: AsyncIterator[Delta]) -> dict[str, Any]:
        parts = [first[0]]
        lps = list(first[1])
        async for delta, lp in deltas:
            parts.append(delta)
            lps += lp
        self._finished()
        content = "".join(parts)
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason,
                                  "logprobs": self._logprobs(lps)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = content
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": self.usage()}

    async def sse(self, head: Delta, deltas: AsyncIterator[Delta], include_usage: bool
                  ) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        first = True
        try:
            async for delta, lp in _chain(head, deltas):
                choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(lp),
                                          "finish_reason": None}
                if self.chat:
                    choice["delta"] = {"content": delta, **({"role": "assistant"} if first
                                                            else {})}
                else:
                    choice["text"] = delta
                first = False
                yield _event({"id": self.rid, "object": kind, "created": self.created,
                              "model": self.model, "choices": [choice]})
            self._finished()
            end: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason,
                                   "logprobs": None}
            end["delta" if self.chat else "text"] = {} if self.chat else ""
            yield _event({"id": self.rid, "object": kind, "created": self.created,
                          "model": self.model, "choices": [end]})
            if include_usage:
                yield _event({"id": self.rid, "object": kind, "created": self.created,
                              "model": self.model, "choices": [], "usage": self.usage()})
        except MeshError as e:
            self.metrics.failures.inc()
            yield _event({"error": {"message": str(e), "type": _error_kind(e.status),
                                    "param": None, "code": e.status}})
        yield "data: [DONE]\n\n"

    def _logprobs(self, lps: list[tuple[int, dict[int, Logprob]]]) -> dict[str, Any] | None:
        if self.logprobs is None or not lps:
            return None
        word = self.tok.decode
        if self.chat:
            return {"content": [{
                "token": word([t]), "logprob": d[t].logprob,
                "bytes": list(word([t]).encode()),
                "top_logprobs": [{"token": word([k]), "logprob": v.logprob,
                                  "bytes": list(word([k]).encode())}
                                 for k, v in sorted(d.items(), key=lambda kv: kv[1].rank)
                                 if v.rank <= self.logprobs]} for t, d in lps]}
        return {"tokens": [word([t]) for t, _ in lps],
                "token_logprobs": [d[t].logprob for t, d in lps],
                "top_logprobs": [{word([k]): v.logprob for k, v in d.items()
                                  if v.rank <= self.logprobs} for _, d in lps],
                "text_offset": []}


async def _chain(head: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    yield head
    async for item in rest:
        yield item


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
