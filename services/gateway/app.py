"""The gateway's HTTP edge: the OpenAI API over the PD mesh.

    POST /v1/completions, /v1/chat/completions  (SSE when "stream": true)
    GET  /v1/models, /health, /metrics; vLLM's others: endpoints.py

A request: validated and tokenized here -> a ``Journey`` through the mesh (journey.py)
-> its TokenDeltas written as the OpenAI answer (answer.py; a chat's reasoning and tool
calls by chat_output.py, its grammar by constraints.py). Every failure answers in
OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``: 400 naming the
field for a malformed request, 401 without the API key (every path but /health and
/ping when one is set), 404 for an unknown model or path, 408 / 413 for a body sent too slowly or
too large (guard.py), 429 with ``Retry-After`` when the gateway already has
``--max-queued-requests`` requests in flight or every instance refused the request at
its own queue limit, 503 when the mesh cannot serve, 500 (still JSON) for a fault of
the gateway's own. Never a 200 with an empty body: a failure after a stream has started
is sent as an error event before ``[DONE]``. The model is checked before anything is
tokenized, and tokenizing runs on worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from pdmesh.services.gateway.answer import Answer
from pdmesh.services.gateway.chat_output import ChatOutput, OutputSettings
from pdmesh.services.gateway.clients import GrpcClients
from pdmesh.services.gateway.constraints import (
    bad_words_token_ids,
    grammar_for,
    logit_bias_for,
    tool_grammar,
    wants_grammar,
)
from pdmesh.services.gateway.embeddings import add_route as add_embeddings
from pdmesh.services.gateway.endpoints import add_routes
from pdmesh.services.gateway.errors import MeshError, error
from pdmesh.services.gateway.guard import ApiKey, BodyGuard, InFlight, InFlightLimit
from pdmesh.services.gateway.journey import (
    Journey,
    JourneyTrace,
    Mesh,
    MeshRequest,
    RetryPolicy,
)
from pdmesh.services.gateway.lora_admin import add_lora_routes
from pdmesh.services.gateway.many import merge_whole, merged_sse
from pdmesh.services.gateway.metrics import GatewayMetrics
from pdmesh.services.gateway.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    _Base,
    render_chat,
)
from pdmesh.services.gateway.router import Router
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.engine.structured import GrammarCompiler
from pdmesh.shared.infra.metrics import VllmNames
from pdmesh.shared.infra.tracing import Tracing
from pdmesh.shared.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")



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
    max_body_bytes: int = 8 << 20  # --max-request-body-bytes
    body_timeout_s: float = 30.0  # --request-body-timeout
    stall_timeout_s: float = 10.0  # --stall-timeout
    rpc_timeout_s: float = 600.0  # VLLM_RPC_TIMEOUT: a prefill call, a decode stream's silence
    trust_request_chat_template: bool = False  # --trust-request-chat-template
    # what a request's unset sampling fields take (--generation-config and its overrides)
    sampling_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    model_path: str = ""  # the model as given (--model): a model card's root, as vLLM's
    instance_grace_s: float = 15.0  # --instance-grace
    output: OutputSettings = OutputSettings()  # the chat output's parsers
    metrics_names: str = "pdmesh"  # --metrics-names (vllm: /metrics as vllm:X)
    eos_token_ids: tuple[int, ...] = ()  # the model's (config and generation config)
    force_include_usage: bool = False  # --enable-force-include-usage: every stream's usage
    stream_interval: int = 1  # --stream-interval: tokens a streamed chunk holds (the last: fewer)
    return_hidden_states: bool = False  # --enable-return-hidden-states: the request field


class Gateway:
    """The routes, over one mesh (router, gRPC clients, metrics)."""

    def __init__(self, state: GatewayState):
        self.state = state
        self.clients = GrpcClients()
        self.metrics = GatewayMetrics(state.model_name, state.router, state.max_model_len)
        self.mesh = Mesh(state.router, self.clients, self.clients,
                         RetryPolicy(timeout_s=state.rpc_timeout_s,
                                     stall_timeout_s=state.stall_timeout_s,
                                     instance_grace_s=state.instance_grace_s),
                         events=self.metrics)
        self.tracing = state.tracing or Tracing("pdmesh-gateway", None)
        self.in_flight = InFlight()  # generation requests being answered (/load)
        self.vocab_size = state.tokenizer.vocab_size
        # a grammar that accepts nothing is a 400 here, not a failed generation there
        # (the tokenizer built for llguidance on the first grammar asked for)
        file = getattr(state.tokenizer, "file", None)
        self._accepts = None if file is None else GrammarCompiler(
            file, self.vocab_size, state.eos_token_ids).check_accepts
        # a text longer than this holds more than max_model_len tokens, whatever they are
        # (None: the tokenizer's tokens are not bounded in length); 4x for normalizers
        # that compose characters (NFC: "e" + a combining accent is one)
        per_token = state.tokenizer.max_token_chars
        self.max_text_chars = (None if per_token is None
                               else 4 * state.max_model_len * per_token)

    async def health(self) -> JSONResponse:
        router = self.state.router
        n_pre, n_dec, n_mix = (len(router.live(r)) for r in ("prefill", "decode", "mixed"))
        n_pool = sum(len(router.live(r, runner="pooling")) for r in ("prefill", "mixed"))
        # decode instances alone still serve (they prefill themselves), slower: degraded
        ok = n_dec > 0 or n_mix > 0 or n_pool > 0
        status = ("ok" if n_pre > 0 or n_mix > 0 or n_pool > 0 else "degraded") if ok \
            else "unavailable"
        return JSONResponse(status_code=200 if ok else 503,
                            content={"status": status, "prefill": n_pre, "decode": n_dec,
                                     "mixed": n_mix, "pooling": n_pool})

    async def prometheus(self) -> Response:
        registry = self.metrics.registry
        served = VllmNames(registry) if self.state.metrics_names == "vllm" else registry
        return PlainTextResponse(generate_latest(served),  # type: ignore[arg-type]
                                 media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> dict[str, Any]:
        now = int(time.time())  # (vLLM's model cards: the time of the answer)
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": now, "owned_by": "pdmesh",
            "root": self.state.model_path or name, "parent": None,
            "max_model_len": self.context_len(), "permission": [_permission(now)]}
            for name in self.names] + [{  # (adapters: their base as parent, as vLLM lists)
            "id": name, "object": "model", "created": now, "owned_by": "pdmesh",
            "root": path, "parent": self.names[0], "max_model_len": self.context_len(),
            "permission": [_permission(now)]} for name, path in self.adapters().items()]}

    def context_len(self) -> int:
        """The longest sequence the mesh serves: the gateway's --max-model-len (else the
        checkpoint's), and no more than any registered engine's own."""
        router = self.state.router
        engines = [i.load.get("max_model_len", 0) for role in ("prefill", "decode", "mixed")
                   for runner in ("generate", "pooling")
                   for i in router.instances(role, runner)]
        return min([self.state.max_model_len, *(n for n in engines if n > 0)])

    @property
    def names(self) -> tuple[str, ...]:
        return self.state.model_names or (self.state.model_name,)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        refused = self._check_model(body)
        if refused is not None:
            return refused
        given = _prompts(body.prompt)
        if not given:
            return error(400, "prompt: must not be empty", "prompt")
        if len(given) * body.choices_generated() > MAX_CHOICES:
            return error(400, f"prompt: {len(given)} prompts x {body.choices_generated()} "
                              f"choices is more than the {MAX_CHOICES} answers one request "
                              f"may ask for", "prompt")
        prompts = []
        for one in given:  # a batch: each prompt its own choices (vLLM's order)
            prompt = await self._completion_prompt(body, one)
            if isinstance(prompt, JSONResponse):
                return prompt
            prompts.append(prompt)
        echoes = [self._echo(one, prompt) if body.echo else ""
                  for one, prompt in zip(given, prompts, strict=True)]
        return await self.serve(body, prompts, False, request, echoes)

    def _echo(self, given: str | list[int], prompt: list[int]) -> str:
        """The prompt as given, token ids as their text (echo puts it before the answer)."""
        return given if isinstance(given, str) else self.state.tokenizer.decode(
            prompt, skip_special_tokens=False)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        refused = self._check_model(body)
        if refused is not None:
            return refused
        try:
            output = ChatOutput(body, self.state.output)
        except ValueError as e:
            return error(400, str(e), "tool_choice")
        try:
            text = render_chat(self.state.tokenizer, body,
                               self.state.trust_request_chat_template)
        except ValueError as e:
            return error(400, str(e), "chat_template" if str(e).startswith("chat_template")
                         else "messages")
        prompt = await self._tokenize(text, "messages",
                                      add_special_tokens=bool(body.add_special_tokens))
        if isinstance(prompt, JSONResponse):
            return prompt
        return await self.serve(body, [prompt], True, request, output=output,
                                prompt_text=text)

    def _pools_only(self) -> bool:
        """Every instance of the model serves embeddings; none generates."""
        router = self.state.router
        roles = ("prefill", "decode", "mixed")
        return not any(router.instances(r) for r in roles) and \
            any(router.instances(r, runner="pooling") for r in roles)

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters the mesh serves: name -> folder (--lora-modules, and those
        loaded at runtime through any gateway)."""
        return self.state.router.adapters()

    def _check_model(self, body: _Base) -> JSONResponse | None:
        """The 404 / 400 of a request for a model or adapter not served here; else
        None, the adapter it runs set on it (its name and folder as served now)."""
        served = self.adapters()
        body._adapter = self.adapter(body, served)
        if body.lora_path is not None and body._adapter is None:
            return error(400, f"lora_path: no LoRA adapter {body.lora_path!r} is served here "
                              f"(serving {', '.join(map(repr, served)) or 'none'})",
                         "lora_path")
        if body.model in self.names or body.model in served:
            return None
        return self.refuse_model(body.model)

    def adapter(self, body: _Base, served: dict[str, str]) -> tuple[str, str] | None:
        """The LoRA adapter a request runs, (name, folder): SGLang's ``lora_path`` (an
        adapter's name or folder), else its ``model`` when that names one (vLLM's way);
        None: the base model."""
        if body.lora_path is not None:
            return next(((name, path) for name, path in served.items()
                         if body.lora_path in (name, path)), None)
        return (body.model, served[body.model]) if body.model in served else None

    def refuse_model(self, name: str) -> JSONResponse:
        return error(404, f"model: {name!r} is not served here (serving "
                          f"{', '.join(repr(n) for n in self.names)})", "model")

    async def _completion_prompt(self, body: CompletionRequest, p: str | list[int]
                                 ) -> list[int] | JSONResponse:
        """One prompt of the request as token ids (a 400 naming ``prompt``)."""
        if isinstance(p, str):
            return await self._tokenize(p, "prompt", add_special_tokens=body.add_special_tokens)
        if not p:
            return error(400, "prompt: must not be empty", "prompt")
        bad = next((t for t in p if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return error(400, f"prompt: token id {bad} is outside the vocabulary "
                              f"[0, {self.vocab_size})", "prompt")
        return list(p)

    async def _tokenize(self, text: str, field: str, add_special_tokens: bool = True
                        ) -> list[int] | JSONResponse:
        """``text``'s tokens, on a worker thread; a 400 naming ``field`` for a text that
        cannot fit max_model_len, told by its length before any tokenizing (``serve``
        checks the token count)."""
        limit = self.max_text_chars
        if limit is not None and len(text) > limit:
            return error(400, f"{field}: {len(text)} characters are more than "
                              f"max_model_len ({self.state.max_model_len}) tokens can "
                              f"hold", field)
        return await asyncio.to_thread(self.state.tokenizer.encode, text, add_special_tokens)

    async def serve(self, body: _Base, prompts: list[list[int]], chat: bool, request: Request,
                    echoes: list[str] | None = None, output: ChatOutput | None = None,
                    prompt_text: str | None = None) -> Response:
        """Answer ``body`` on ``prompts`` (a completion's batch; one for a chat, whose
        rendered text is ``prompt_text``): each prompt's choices (n, or best_of's
        candidates) in the order vLLM numbers them."""
        field = "messages" if chat else "prompt"
        if body.return_hidden_states and not self.state.return_hidden_states:
            return error(400, "return_hidden_states: this server was not started with "
                              "--enable-return-hidden-states", "return_hidden_states")
        if self._pools_only():
            return error(400, "model: runs the pooling runner (--runner pooling, "
                              "--is-embedding): it serves /v1/embeddings, not "
                              "generation", "model")
        context = self.context_len()  # (once: it reads every registered instance)
        runs, echoes = [], list(echoes or [""] * len(prompts))
        for g, given in enumerate(prompts):
            prompt = body.truncated(given, context - 1)
            if echoes[g] and len(prompt) < len(given):  # echo what the model was given
                echoes[g] = self.state.tokenizer.decode(prompt, skip_special_tokens=False)
            try:
                runs.append((prompt, await self._params(body, prompt, field, output,
                                                        context)))
            except ValueError as e:  # "field: why"
                return error(400, str(e), str(e).split(":", 1)[0])
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        span = self._span(rid, chat, runs[0][0], body, request.headers)
        k = body.choices_generated()
        answers = [self._answer(rid, g * k + j, body, prompt, params, span, echoes[g],
                                output, prompt_text)
                   for g, (prompt, params) in enumerate(runs) for j in range(k)]
        try:  # the first token before any answer: a failure here gets its status code
            if not await _unless_gone(self._first_tokens(answers, k), request):
                return await _left(answers)  # (before its first token: queued, computing)
            if not body.stream:
                return await self._whole(answers, body.n, k, request)
        except MeshError as e:
            for a in answers:
                await a.close()
            (self.metrics.rejected if e.status == 429 else self.metrics.failures).inc()
            return error(e.status, str(e))
        include_usage = self.state.force_include_usage or bool(
            (body.stream_options or {}).get("include_usage"))
        events = answers[0].sse(include_usage) if len(answers) == 1 else \
            merged_sse(answers, k, include_usage)
        return StreamingResponse(events, media_type="text/event-stream")

    def _answer(self, rid: str, i: int, body: _Base, prompt: list[int],
                params: SamplingParams, span: Any, echo: str, output: ChatOutput | None,
                prompt_text: str | None = None) -> Answer:
        """Answer ``i`` (prompt i // k's choice i % k, k choices generated per prompt)
        and its journey (``answer.journey``): a seeded request's choice j draws from
        seed + j; best_of's candidates bring their sampled tokens' logprobs (to be
        ranked by), shown only when asked for; prompt logprobs are the first choice's
        (the others find the prompt cached instead of computing it again)."""
        state = self.state
        engine = params
        j = i % body.choices_generated()
        if i:
            rid = f"{rid}-{i}"
            if output is not None:  # (each choice parses its own text)
                first, output = output, ChatOutput(body, state.output)  # type: ignore[arg-type]
                output.constrained = first.constrained
        if j and params.seed is not None:
            engine = dataclasses.replace(engine, seed=(params.seed + j) % (1 << 63))
        if j and params.prompt_logprobs is not None:  # the first choice's serve them all:
            engine = dataclasses.replace(engine, prompt_logprobs=None)  # the KV is cached
        if body.choices_generated() > body.n and params.logprobs is None:
            engine = dataclasses.replace(engine, logprobs=0)
        answer = Answer(rid, body.model, output is not None, prompt, params,
                        body.stop_strings(), state.tokenizer, self.metrics, span,
                        state.log_requests, echo, output, i, body.shape(),
                        state.eos_token_ids, prompt_text, state.stream_interval)
        answer.journey = Journey(self.mesh, MeshRequest(rid, prompt, engine, body.priority,
                                                        *(body._adapter or (None, None))),
                                 JourneyTrace(self.tracing, span) if span is not None
                                 else None)
        return answer

    async def _params(self, body: _Base, prompt: list[int], field: str,
                      output: ChatOutput | None, context: int) -> SamplingParams:
        """The engine's parameters for ``body`` on ``prompt`` within ``context`` tokens;
        ValueError "field: why" for what cannot be served: no room in the context, a
        token id past the vocabulary, a grammar that does not compile, a value out of
        range."""
        if not prompt:
            raise ValueError(f"{field}: must not be empty")
        if len(prompt) >= context:
            raise ValueError(f"{field}: {len(prompt)} tokens leaves no room to generate "
                             f"within max_model_len ({context})")
        asked = body.asked_max_tokens()
        if asked is not None and asked[1] > context - len(prompt):
            name, n = asked  # vLLM's refusal: past the context is a 400, not a cut
            raise ValueError(f"{name}: {n} is too large: this model's maximum context "
                             f"length is {context} tokens and the request has "
                             f"{len(prompt)} input tokens ({n} > {context} - {len(prompt)})")
        bad = next((t for t in body.stop_token_ids or () if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: token id {bad} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        params = body.to_sampling(context - len(prompt), self.state.sampling_defaults)
        grammar = None
        if wants_grammar(body):  # compiled off the event loop: a schema can be large
            grammar = await asyncio.to_thread(grammar_for, body, self._accepts)
        forced = await asyncio.to_thread(tool_grammar, output, body,
                                         self._accepts) if output else None
        after = None
        if output is not None and (grammar or forced) is not None:
            after = output.grammar_after()
            output.constrained = output.thinks and after is None
        if forced is not None and grammar is not None:
            raise ValueError("tool_choice: a forced tool call is itself structured output; "
                             "it cannot take response_format or guided_* as well")
        bias = logit_bias_for(body, self.vocab_size)
        banned = await asyncio.to_thread(bad_words_token_ids, body.bad_words,
                                         self.state.tokenizer) if body.bad_words else []
        keep = output is not None and output.keeps_special_tokens
        if grammar is None and forced is None and not bias and not banned and not keep:
            return params
        return dataclasses.replace(params, grammar=grammar or forced, grammar_after=after,
                                   logit_bias=bias, bad_words_token_ids=banned,
                                   skip_special_tokens=params.skip_special_tokens and not keep)

    @staticmethod
    async def _first_tokens(answers: list[Answer], k: int) -> bool:
        """Every answer's first token (each prompt's other choices after its first: its
        KV is in the pool for them)."""
        await _all(a.start(a.journey.run()) for a in answers[::k])
        await _all(a.start(a.journey.run()) for i, a in enumerate(answers) if i % k)
        for i, a in enumerate(answers):  # (the first's: the others did not ask)
            a.prompt_logprobs = answers[i - i % k].prompt_logprobs
        return True

    @staticmethod
    async def _whole(answers: list[Answer], n: int, k: int, request: Request) -> Response:
        """The whole answer; a client that leaves before it is ready aborts the request
        (its journeys closed: the instances stop and free its KV), as a stream's does."""
        whole = await _unless_gone(_all(a.whole() for a in answers), request)
        if whole is None:
            return await _left(answers)
        return JSONResponse(merge_whole(answers, whole, n, k))

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


async def _all(coros: Any) -> list[Any]:
    """Every coroutine's result; when one fails (or this is cancelled), the others are
    cancelled and waited for before the error goes on - no choice runs on unanswered."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _prompts(p: Any) -> list[str | list[int]]:
    """A completion's prompts: a string, token ids, or a list of either (a batch)."""
    if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
        return [p]
    return list(p)


def _permission(now: int) -> dict[str, Any]:
    """A model card's permission entry, as vLLM (and OpenAI's older API) give it."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
            "created": now, "allow_create_engine": False, "allow_sampling": True,
            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
            "allow_fine_tuning": False, "organization": "*", "group": None,
            "is_blocking": False}


async def _unless_gone(work: Coroutine[Any, Any, T], request: Request) -> T | None:
    """``work``'s result, or None once the client has gone first (``work`` cancelled and
    waited for: a request queued or computing on an instance is aborted there, as a
    stream's is when its reader leaves). Its error, if it fails first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:  # (also when this handler is cancelled)
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def _left(answers: list[Answer]) -> Response:
    """The client left before its answer: every journey closed, nothing more sent."""
    for a in answers:
        await a.close()
    log.info("request %s: the client left before its answer; aborted", answers[0].rid)
    return Response(status_code=499)  # (nobody reads it)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read already: what the server
    receives next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(state: GatewayState) -> FastAPI:
    app = FastAPI(title="pdmesh gateway")
    gw = Gateway(state)
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _fault)
    # middlewares run last-added first: the key, then the body read whole, then a slot
    app.add_middleware(InFlightLimit, limit=state.max_queued_requests,
                       rejected=gw.metrics.rejected, counter=gw.in_flight, error=error)
    app.add_middleware(BodyGuard, max_bytes=state.max_body_bytes,
                       timeout_s=state.body_timeout_s, error=error)
    if state.api_key:  # a refused key takes no slot and sends no body
        app.add_middleware(ApiKey, key=state.api_key, error=error)
    app.router.on_shutdown.append(gw.clients.close)
    app.get("/health")(gw.health)
    app.get("/metrics")(gw.prometheus)
    app.get("/v1/models")(gw.models)
    app.post("/v1/completions")(gw.completions)
    app.post("/v1/chat/completions")(gw.chat)
    add_routes(app, gw)
    add_lora_routes(app, gw)
    add_embeddings(app, gw)
    return app


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    # of a union's alternatives (prompt: a string, or token ids, ...), the one that got
    # furthest says the most ("prompt.0: ... less than or equal to 2147483647")
    top = _where(first)[:1]
    first = max((e for e in errors if _where(e)[:1] == top), key=lambda e: len(_where(e)),
                default=first)
    field = ".".join(_where(first)) or None
    return error(400, f"{field or 'body'}: {first.get('msg', 'invalid request')}", field)


def _where(err: dict[str, Any]) -> list[str]:
    """A validation error's field path, less "body" and pydantic's union branch tags."""
    return [str(p) for p in err.get("loc", ()) if p != "body" and not (
        isinstance(p, str) and (not p.isidentifier() or p in _TYPE_TAGS))]


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (no such path, wrong method) in OpenAI's shape."""
    return error(exc.status_code, f"{request.url.path}: {exc.detail}")


async def _fault(request: Request, exc: Exception) -> JSONResponse:
    """A fault of the gateway's own: logged, and still answered in JSON."""
    log.exception("%s %s failed", request.method, request.url.path)
    return error(500, f"the gateway failed on this request ({type(exc).__name__}); it is "
                      f"logged")
