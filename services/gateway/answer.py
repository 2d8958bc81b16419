"""One request's answer in OpenAI's shapes, whole or as SSE events, written straight
from the journey's TokenDeltas: text released as it becomes final (stop strings and
incomplete characters held back), logprobs, usage; and on the way the gateway's
per-request metrics, the --log-requests line and the request's span.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pdmesh.services.gateway.chat_output import ChatOutput
from pdmesh.services.gateway.detokenize import IncrementalText
from pdmesh.services.gateway.errors import MeshError, error_type
from pdmesh.services.gateway.metrics import GatewayMetrics
from pdmesh.services.gateway.protocol import Shape
from pdmesh.shared.engine.request import Logprob
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.infra.logs import REQUEST_LOG, request_record
from pdmesh.shared.models.tokenizer import Tokenizer
from pdmesh.shared.runtime.protocol import TokenDelta

_REQUESTS = logging.getLogger(REQUEST_LOG)
_REQUESTS.setLevel(logging.INFO)  # --log-requests shows them whatever --log-level says


class Answer:
    def __init__(self, rid: str, model: str, chat: bool, prompt: list[int],
                 params: SamplingParams, stops: list[str], tok: Tokenizer,
                 metrics: GatewayMetrics, span: Any = None, log_level: int | None = None,
                 echo: str = "", output: ChatOutput | None = None, index: int = 0,
                 shape: Shape | None = None, eos_token_ids: tuple[int, ...] = (),
                 prompt_text: str | None = None, stream_interval: int = 1):
        self.rid, self.model, self.chat, self.prompt = rid, model, chat, prompt
        # after the first token, deltas are held until they carry this many tokens (or
        # the answer ends): --stream-interval, vLLM's and SGLang's
        self.stream_interval = stream_interval
        self.prompt_text = prompt_text  # a chat's prompt as its template rendered it
        self.index = index  # its choice's index (n > 1: one Answer per choice)
        self.journey: Any = None  # the Journey it answers (set by the gateway)
        self.cumulative_logprob = 0.0  # of its sampled tokens, when they come with them
        self.echo = echo  # a completion's prompt text, put before its answer (echo)
        self.output = output  # a chat's reasoning and tool calls (None: a completion)
        self._split_char: list[int] = []  # a character's first tokens (reasoning counts)
        self._text_offset = 0  # a completion's logprobs: the text their tokens spell so far
        self.params, self.tok, self.metrics = params, tok, metrics
        self.span = span  # the request's trace span, ended with the answer
        self.log_level = log_level  # log the request when it ends (--log-requests)
        self.shape = shape or Shape()
        self.token_ids: list[int] = []  # the tokens generated (return_token_ids)
        # what ends a sequence (the model's, its generation config's too): not text
        self.eos = frozenset(eos_token_ids or (tok.eos_token_id,))
        # the tokenizer's end of sequence is no stop_reason; generation_config's other
        # ids are stop ids to vLLM, reported as the token that stopped it
        self.stop_ids = frozenset(params.stop_token_ids) | (self.eos - {tok.eos_token_id})
        self.text = IncrementalText(tok, stops, params.skip_special_tokens,
                                    self.shape.include_stop_str)
        self.stop_reason: str | int | None = None  # the stop string or stop token id
        self.created = int(time.time())
        self.t0 = time.perf_counter()
        self.ttft: float | None = None
        self._last: float | None = None  # when the last token reached us
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.done = False
        self._journey: AsyncIterator[TokenDelta] | None = None
        self._head: TokenDelta | None = None
        # one per prompt token (the first: None), when prompt_logprobs asked for them
        self.prompt_logprobs: list[dict[int, Logprob] | None] = []
        self.hidden_states: list[float] = []  # the last delta's, when asked

    async def start(self, journey: AsyncIterator[TokenDelta]) -> None:
        """Wait for the first token before answering anything: a MeshError raised here
        still gets its own HTTP status."""
        self._journey = journey
        try:
            self._head = await anext(journey)
        except BaseException:
            await self.close()
            raise
        self.cached_tokens = self._head.num_cached_tokens
        self.prompt_logprobs = self._head.prompt_logprobs  # (they come with the first token)

    # -- the two shapes ------------------------------------------------------------------
    async def whole(self) -> dict[str, Any]:
        parts: list[str] = [self.echo]
        lps = self._echoed()
        async for delta in self._deltas():
            parts.append(self._take(delta))
            lps += zip(delta.token_ids, delta.logprobs, strict=False)
        self._finished()
        content = "".join(parts)
        choice: dict[str, Any] = {"index": self.index, "finish_reason": self.finish_reason,
                                  "stop_reason": self.stop_reason,
                                  "logprobs": self._logprobs(lps),
                                  "token_ids": self._ids(self.token_ids),
                                  "routed_experts": None}  # (vLLM's, never asked here)
        prompt = {"prompt_logprobs": None if self.params.prompt_logprobs is None
                  else self._prompt_logprobs(),
                  "prompt_token_ids": self._ids(self.prompt, prompt=True)}
        whole = {"id": self.rid, "object": "chat.completion" if self.chat
                 else "text_completion", "created": self.created, "model": self.model,
                 "system_fingerprint": None, "service_tier": None, "choices": [choice],
                 "usage": self.usage(), **_VLLM_EXTRAS}
        if self.params.return_hidden_states:  # (SGLang's: the last fed token's)
            choice["hidden_states"] = self.hidden_states
        if self.output is not None:  # (vLLM's places: the chat's at the top)
            choice["message"] = self.output.message(content)
            choice["finish_reason"] = self.output.finish_reason(self.finish_reason)
            whole.update(prompt, prompt_text=self._prompt_text())
        else:
            choice.update(prompt, text=content)
        return whole

    def _ids(self, ids: list[int], prompt: bool = False) -> list[int] | None:
        """Token ids as return_token_ids asks for them (else null, as vLLM answers); the
        answer's not when they would show a reasoning left out (include_reasoning)."""
        return list(ids) if self.shape.token_ids and (prompt or not self._hidden) else None

    @property
    def _hidden(self) -> bool:
        return self.output is not None and self.output.hides_reasoning

    def _prompt_text(self) -> str | None:
        return self.prompt_text if self.shape.prompt_text else None

    async def sse(self, include_usage: bool) -> AsyncIterator[str]:
        try:
            async for event in (self._chat_events() if self.output is not None
                                else self._text_events()):
                yield event
            if self.params.return_hidden_states and self.hidden_states:
                yield self._hidden_states_event()
            if include_usage:
                yield self._event([], usage=self.usage(streamed=True))
        except MeshError as e:
            self.metrics.failures.inc()
            yield _sse({"error": {"message": str(e), "type": error_type(e.status),
                                  "param": None, "code": e.status}})
        yield "data: [DONE]\n\n"

    async def _text_events(self) -> AsyncIterator[str]:
        """A completion's chunks: each delta's text (the echo before the first)."""
        first = True
        async for delta in self._deltas():
            text = self._take(delta)
            if not text and not delta.token_ids and not first:
                continue  # only the finish reason (sent below)
            lps = self._echoed() if first else []
            lps += zip(delta.token_ids, delta.logprobs, strict=False)
            yield self._event([{"index": self.index,
                                "text": self.echo + text if first else text,
                                "logprobs": self._logprobs(lps), "finish_reason": None,
                                "prompt_token_ids": self._ids(self.prompt, prompt=True) if first
                                else None, "token_ids": self._ids(delta.token_ids)}])
            first = False
        self._finished()
        yield self._event([{"index": self.index, "text": "", "logprobs": None,
                            "finish_reason": self.finish_reason, "prompt_token_ids": None,
                            "token_ids": self._ids([])}])

    async def _chat_events(self) -> AsyncIterator[str]:
        """A chat's chunks: the role alone first (as vLLM sends it), then what the
        output's parsers make of each delta's text (reasoning, content, tool calls),
        the logprobs of tokens held back riding with the next chunk sent."""
        output = self.output
        assert output is not None
        yield self._event([_chat_chunk({"role": "assistant", "content": ""}, None, self.index)],
                          prompt_token_ids=self._ids(self.prompt, prompt=True),
                          prompt_text=self._prompt_text())
        pending: list[tuple[int, dict[int, Logprob]]] = []
        ids: list[int] = []  # (the tokens of the text held back, likewise)
        async for delta in self._deltas():
            text = self._take(delta)
            pending += zip(delta.token_ids, delta.logprobs, strict=False)
            ids += delta.token_ids
            for part in output.feed(text) if text else []:
                yield self._event([_chat_chunk(part, self._logprobs(pending), self.index,
                                               self._ids(ids))])
                pending, ids = [], []
        for part in output.finish():
            yield self._event([_chat_chunk(part, self._logprobs(pending), self.index,
                                           self._ids(ids))])
            pending, ids = [], []
        self._finished()
        end = _chat_chunk({}, self._logprobs(pending), self.index, self._ids(ids))
        end["finish_reason"] = output.finish_reason(self.finish_reason)
        yield self._event([end])

    def _hidden_states_event(self) -> str:
        """SGLang's chunk after the finish: the choice's hidden states alone."""
        if self.chat:
            return self._event([{"index": self.index, "delta": {}, "logprobs": None,
                                 "finish_reason": None,
                                 "hidden_states": self.hidden_states}])
        return self._event([{"index": self.index, "text": "", "logprobs": None,
                             "finish_reason": None, "hidden_states": self.hidden_states}])

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        if choices and self.shape.continuous_usage and "usage" not in extra:
            extra["usage"] = self.usage(streamed=True)  # (continuous_usage_stats: so far)
        for c in choices:
            if c.get("finish_reason"):
                c["stop_reason"] = self.stop_reason
        return _sse({"id": self.rid, "object": "chat.completion.chunk" if self.chat
                     else "text_completion", "created": self.created, "model": self.model,
                     "system_fingerprint": None, "choices": choices, **extra})

    # -- deltas in -----------------------------------------------------------------------
    async def _deltas(self) -> AsyncIterator[TokenDelta]:
        """The journey's deltas until the answer is done (a stop string may end it
        before the journey does); then the journey is closed and the request accounted."""
        try:
            delta = self._head
            while delta is not None:
                yield delta
                if self.done:
                    return
                delta = await self._next()
        finally:
            await self.close()

    async def _next(self) -> TokenDelta | None:
        """The journey's next delta, with those after it while it holds fewer than
        ``stream_interval`` tokens and has not ended."""
        delta = await anext(self._journey, None)
        while delta is not None and not delta.finished and \
                len(delta.token_ids) < self.stream_interval:
            more = await anext(self._journey, None)
            if more is None:
                break
            delta = delta.then(more)
        return delta

    def _pieces(self, ids: list[int]) -> list[tuple[str, int]]:
        """Each token's text, with 1; the tokens of a character split over several (up to
        four bytes), together: the text, and how many."""
        out = []
        for t in ids:
            self._split_char.append(t)
            text = self.tok.decode(self._split_char, skip_special_tokens=False)
            if text.endswith("\ufffd") and len(self._split_char) < 4:
                continue
            out.append((text, len(self._split_char)))
            self._split_char = []
        return out

    def _take(self, delta: TokenDelta) -> str:
        """The text ``delta`` makes final; sets ``done`` at a stop string or the end."""
        self.completion_tokens += len(delta.token_ids)
        if delta.hidden_states:
            self.hidden_states = delta.hidden_states
        if self.shape.token_ids:
            self.token_ids += delta.token_ids
        if self.output is not None and self.output.counting:  # (its reasoning tokens)
            self.output.count(self._pieces(delta.token_ids))
        for t, lp in zip(delta.token_ids, delta.logprobs, strict=False):
            self.cumulative_logprob += lp[t].logprob if t in lp else 0.0
        self._timing(len(delta.token_ids))
        ids = delta.token_ids
        if ids and not self.shape.include_stop_str and self._stops_on(ids[-1]):
            ids = ids[:-1]  # the stop token is not text (kept specials would show it)
        text = self.text.add(ids)
        if self.text.stopped:
            self.finish_reason, self.done = "stop", True
            self.stop_reason = self.text.stop_string
        elif delta.finish_reason:
            self.finish_reason, self.done = delta.finish_reason, True
            text += self.text.flush()
            if self.text.stopped:
                self.stop_reason = self.text.stop_string
            elif delta.finish_reason == "stop" and delta.token_ids and \
                    delta.token_ids[-1] in self.stop_ids:
                self.stop_reason = delta.token_ids[-1]  # (the end of sequence: None)
        return text

    def _stops_on(self, token: int) -> bool:
        """Whether ``token``, just generated, ends the request as the engine ends it (so
        it is the last): a stop token id once min_tokens are out, or the end of sequence."""
        p = self.params
        if self.completion_tokens < p.min_tokens:
            return False
        return token in p.stop_token_ids or (token in self.eos and not p.ignore_eos)

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

    async def close(self) -> None:
        """Once: the journey closed (its gRPC calls cancelled), the request accounted."""
        journey, self._journey = self._journey, None
        if journey is None:
            return
        await journey.aclose()  # type: ignore[attr-defined]
        self.metrics.generation_tokens.inc(self.completion_tokens)
        if self.log_level is not None:
            self._log()
        if self.span is not None:
            self.span.set_attribute("pdmesh.completion_tokens", self.completion_tokens)
            self.span.set_attribute("pdmesh.finish_reason", self.finish_reason or "")
            self.span.end()

    # -- what the answer reports ---------------------------------------------------------
    def _finished(self) -> None:
        m = self.metrics
        m.prompt_tokens.inc(len(self.prompt))
        m.success(self.finish_reason or "stop")
        e2e = time.perf_counter() - self.t0
        m.e2e.observe(e2e)
        m.request_prompt_tokens.observe(len(self.prompt))
        m.request_generation_tokens.observe(self.completion_tokens)
        if self.ttft is not None and self.completion_tokens > 1:  # (vLLM's TPOT)
            m.tpot.observe((e2e - self.ttft) / (self.completion_tokens - 1))

    def usage(self, streamed: bool = False) -> dict[str, Any]:
        """The answer's usage; ``streamed``: as a stream's chunk carries it (its null
        fields left out, as vLLM leaves them)."""
        out = {"prompt_tokens": len(self.prompt), "completion_tokens": self.completion_tokens,
               "total_tokens": len(self.prompt) + self.completion_tokens,
               "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
               "completion_tokens_details": self.output.usage_details
               if self.output is not None else None}
        return {f: v for f, v in out.items() if v is not None} if streamed else out

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

    def _echoed(self) -> list[tuple[int, dict[int, Logprob] | None]]:
        """An echoing completion's prompt tokens with their logprobs (the prompt's), when
        logprobs are asked: they come before the answer's, as vLLM gives them."""
        if not self.echo or self.params.logprobs is None:
            return []
        lps = list(self.prompt_logprobs or [])
        lps += [None] * (len(self.prompt) - len(lps))  # (none came: each token without)
        return list(zip(self.prompt, lps, strict=True))

    def _prompt_logprobs(self) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token (the first: null), the prompt's
        own token and the top-n, by token id."""
        word = self._word()
        return [None if d is None else {str(k): {
            "logprob": max(v.logprob, -9999.0), "rank": v.rank, "decoded_token": word([k])}
            for k, v in d.items()} for d in self.prompt_logprobs or [None]]

    def _word(self) -> Any:
        """A token's text in logprobs (``token_id:N`` with return_tokens_as_token_ids)."""
        if self.shape.token_ids_as_text:
            return lambda ids: f"token_id:{ids[0]}"
        return self.tok.decode

    def _logprobs(self, lps: list[tuple[int, dict[int, Logprob] | None]]
                  ) -> dict[str, Any] | None:
        n = self.params.logprobs
        if n is None or not lps or self._hidden:  # (they would show a hidden reasoning)
            return None
        # a token a grammar forbids has logprob -inf, which JSON cannot hold: vLLM's floor
        lps = [(t, None if d is None else {k: Logprob(max(v.logprob, -9999.0), v.rank)
                                           for k, v in d.items()}) for t, d in lps]
        word = self._word()
        if self.chat:
            return {"content": [{
                "token": word([t]), "logprob": d[t].logprob,
                "bytes": list(word([t]).encode()),
                "top_logprobs": [{"token": word([k]), "logprob": v.logprob,
                                  "bytes": list(word([k]).encode())}
                                 for k, v in sorted(d.items(), key=lambda kv: kv[1].rank)
                                 if v.rank <= n]} for t, d in lps]}
        tokens = [word([t]) for t, _ in lps]
        offsets = []  # (each token's place in the whole answer's text, as vLLM counts it)
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {"tokens": tokens,
                "token_logprobs": [None if d is None else d[t].logprob for t, d in lps],
                # the chosen (or echoed) token first, then the n likeliest: vLLM's n + 1
                "top_logprobs": [None if d is None else {
                    word([k]): v.logprob for k, v in sorted(
                        d.items(), key=lambda kv: (kv[0] != t, kv[1].rank))
                    if k == t or v.rank <= n} for t, d in lps],
                "text_offset": offsets}


# vLLM 0.32's fields of a whole answer for what pdmesh does not do (vLLM's own KV and
# encoder-cache transfer parameters, its per-request metrics): null, as vLLM sends them
_VLLM_EXTRAS = {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def _chat_chunk(delta: dict[str, Any], logprobs: dict[str, Any] | None, index: int,
                token_ids: list[int] | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None,
            "token_ids": token_ids}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
