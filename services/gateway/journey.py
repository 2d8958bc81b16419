"""One request's way through the mesh, as explicit steps.

    route ──▶ prefill (a prefill instance; others on failure, with backoff): the first
          │   token goes to the client at once, decode starts once the prompt's KV
          │   is in the pool
          └─▶ offload (prefill backed up: a decode instance computes the prompt itself)
    ──▶ decode session (a decode instance streams the rest)
          ├─ the instance fails mid-stream ──▶ migrate: another decode instance continues
          │    with the tokens so far (prompt from the pool, the rest recomputed)
          ├─ it runs out of KV ("recomputed") ──▶ hand back: re-prefill prompt + tokens
          │    so far, then decode again
          └─ finish
    (no prefill instance, only mixed ones: one mixed instance does it all)

The client's stream goes on unbroken through migrations and hand-backs. Errors the
client caused (INVALID_ARGUMENT) go straight back; anything that cannot be recovered
ends as ``MeshError``; when every instance tried refused the request at its
--max-queued-requests limit, that MeshError is a 429. The journey reaches instances
only through ``PrefillClient`` / ``DecodeClient`` and picks them through the router, so
every path here has unit tests with fakes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdmesh.services.gateway.clients import (
    Call,
    DecodeClient,
    PrefillCall,
    PrefillClient,
    Stored,
)
from pdmesh.services.gateway.errors import (
    RETRYABLE,
    CallFailed,
    MeshError,
    gave_up,
    http_status,
)
from pdmesh.services.gateway.router import Router
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.infra.registry import Instance
from pdmesh.shared.runtime.protocol import TokenDelta

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """How hard the gateway tries before it gives up on a request."""

    prefill_attempts: int = 3  # prefill (and mixed) instances tried per prefill
    decode_attempts: int = 3  # decode instances that may fail one request
    max_hand_backs: int = 16  # times the recompute scheduler may hand one request back
    backoff_s: float = 0.1  # before the next decode instance; doubling for prefill
    timeout_s: float = 600.0  # a prefill call, or a decode stream's silence
    # a decode stream silent this long whose instance stopped heartbeating (gone from
    # the registry: SIGSTOPped, hung whole) is given up on and the request migrates
    stall_timeout_s: float = 10.0
    # no decode instance live: how long a request waits for one to come back (a
    # supervisor restarting it) before it fails
    instance_grace_s: float = 0.0
    grace_poll_s: float = 0.25

    def retryable(self, code: grpc.StatusCode) -> bool:
        return code in RETRYABLE

    def prefill_backoff(self, attempt: int) -> float:
        return self.backoff_s * (2 ** attempt)


class _Counter:
    def inc(self, n: float = 1) -> None:
        pass


class MeshEvents:
    """What a journey reports (the gateway's metrics implement the same): a call retried
    on another instance, a request migrated to another decode instance, one handed back
    by a decode instance's recompute scheduler, one offloaded. These do nothing."""

    migrated = _Counter()
    handed_back = _Counter()
    offloaded = _Counter()

    def retried(self, role: str) -> None:
        pass


@dataclass
class Mesh:
    """What every journey uses: where instances are, how to call them, how hard to try."""

    router: Router
    prefill: PrefillClient
    decode: DecodeClient
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    events: MeshEvents = field(default_factory=MeshEvents)


@dataclass(frozen=True)
class MeshRequest:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    priority: int | None = None
    lora_name: str | None = None  # the LoRA adapter it runs (None: the base model)
    lora_path: str | None = None  # its folder (an instance without it reads it there)


class Outcome(enum.Enum):
    """How one decode session for the request ended."""

    FINISHED = "finished"
    HANDED_BACK = "handed back"  # out of KV there: re-prefill, then decode again
    FAILED = "failed"  # the instance failed or refused: migrate to another


@dataclass
class _Storing:
    """A prefill whose first token went out and whose prompt is still being put."""

    inst: Instance
    call: PrefillCall
    prompt: list[int]
    span: Any


class Journey:
    """One request through the mesh: ``async for delta in Journey(...).run()``. The first
    delta carries the prompt's cached-token count; the last one ``finish_reason``."""

    def __init__(self, mesh: Mesh, request: MeshRequest, trace: Any = None):
        self.mesh = mesh
        self.req = request
        self.trace = trace or NoTrace()  # a JourneyTrace when tracing
        self.tokens: list[int] = []  # generated so far: carried on migration / hand-back
        self.block_keys: list[str] = []  # where the prompt's KV waits in the pool
        self.failed: set[str] = set()  # decode instances that failed this request
        self.codes: list[grpc.StatusCode] = []  # why each of them failed
        self.hand_backs = 0
        self.outcome = Outcome.FAILED  # how the last decode session ended
        self._storing: _Storing | None = None

    async def run(self) -> AsyncIterator[TokenDelta]:
        try:
            async with aclosing(self._run()) as deltas:
                async for delta in deltas:
                    if delta.finish_reason == "error":  # the engine could not go on
                        raise MeshError(f"request {self.req.request_id}: generation failed "
                                        f"on the engine (its log says why)", 500)
                    yield delta
        finally:
            if self._storing is not None:  # the client left before the put ended
                s, self._storing = self._storing, None
                s.call.cancel()
                self.mesh.router.answered(s.inst, s.prompt)
                self.trace.end(s.span)

    async def _run(self) -> AsyncIterator[TokenDelta]:
        router = self.mesh.router
        if not router.instances("prefill") and router.instances("mixed"):
            async with aclosing(self._mixed()) as deltas:
                async for delta in deltas:
                    yield delta
            return
        offload = router.offload_target(self.req.prompt)  # route
        if offload is None:
            try:
                first = await self._prefill()
            except MeshError as e:
                # every prefill instance failed (crashed, not yet out of the registry): a
                # decode instance computes the prompt rather than the request failing
                offload = router.fallback_decode() if e.status == 503 else None
                if offload is None:
                    raise
                log.warning("request %s: no prefill instance could serve it (%s); decode "
                            "instance %s prefills it", self.req.request_id, e, offload.id)
            else:
                yield first
                end = await self._stored()
                if end is not None:
                    yield end
                    return
        if offload is not None:  # this decode instance computes the prompt itself
            self.mesh.events.offloaded.inc()
            router.sent(offload, self.req.prompt)
        while True:
            inst = offload or await self._next_decode_instance()
            async with aclosing(self._decode(inst, offloaded=offload is not None)) as deltas:
                async for delta in deltas:
                    yield delta
            offload = None
            if self.outcome is Outcome.FINISHED:
                return
            if self.outcome is Outcome.HANDED_BACK:
                yield await self._hand_back(inst)
                end = await self._stored()
                if end is not None:
                    yield end
                    return

    # -- steps ---------------------------------------------------------------------------
    async def _prefill(self, carried: list[int] | None = None, span: Any = None
                       ) -> TokenDelta:
        """The next token from a prefill instance, retrying elsewhere with backoff;
        ``carried``: tokens generated before a decode instance handed the request back.
        ``_stored`` then waits for the prompt's put."""
        carried = carried or []
        prompt = self.req.prompt + carried
        tried: set[str] = set()
        codes: list[grpc.StatusCode] = []
        last = "no prefill instance is available"
        retry = self.mesh.retry
        rid = f"{self.req.request_id}-r{self.hand_backs}" if carried else self.req.request_id
        for attempt in range(retry.prefill_attempts):
            inst = self.mesh.router.pick("prefill", exclude=tried, prompt=prompt,
                                         adapter=self.req.lora_name)
            if inst is None:
                break
            try:
                return await self._prefill_on(inst, f"{rid}-p{attempt}", carried, attempt, span)
            except CallFailed as e:
                last = f"prefill {inst.address} failed: {e.code.name}: {e.details}"
                log.warning("request %s: %s", self.req.request_id, last)
                codes.append(e.code)
                if e.code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise MeshError(e.details or "invalid request", http_status(e.code)) from e
                if not retry.retryable(e.code):
                    break
                tried.add(inst.id)
                self.mesh.router.forget()
                self.mesh.events.retried("prefill")
            await asyncio.sleep(retry.prefill_backoff(attempt))
        raise gave_up("prefill", codes, last)

    async def _prefill_on(self, inst: Instance, call_id: str, carried: list[int],
                          attempt: int, parent: Any) -> TokenDelta:
        prompt = self.req.prompt + carried
        router = self.mesh.router
        router.sent(inst, prompt)
        span = self.trace.child("prefill", inst, {"pdmesh.attempt": attempt}, parent)
        call = self.mesh.prefill.prefill(inst, self._call(
            call_id, carried, [], self.trace.carrier(span)), self.mesh.retry.timeout_s)
        try:
            first = await call.first()
        except BaseException:
            call.cancel()
            router.answered(inst, prompt)
            self.trace.end(span)
            raise
        self._storing = _Storing(inst, call, prompt, span)
        self.tokens = carried + first.token_ids
        return first

    async def _stored(self) -> TokenDelta | None:
        """Wait for the prefill's put into the pool; the request's last delta if its
        first token already ended it. A prefill instance that fails now (its first token
        already streamed) leaves decode to compute the prompt itself."""
        s, self._storing = self._storing, None
        assert s is not None
        try:
            stored = await s.call.stored()
        except CallFailed as e:
            log.warning("request %s: prefill %s failed after the first token (%s: %s); "
                        "decode computes the prompt", self.req.request_id, s.inst.address,
                        e.code.name, e.details)
            self.mesh.router.forget()
            stored = Stored([])
        finally:
            self.mesh.router.answered(s.inst, s.prompt)
            self.trace.end(s.span)
        self.block_keys = stored.block_keys
        if stored.finish_reason:
            return TokenDelta(self.req.request_id, finish_reason=stored.finish_reason)
        return None

    async def _next_decode_instance(self) -> Instance:
        """A decode instance that has not failed this request (migration picks again);
        while there is none, one that comes back within the retry policy's grace."""
        retry = self.mesh.retry
        if len(self.failed) >= retry.decode_attempts:
            raise gave_up("decode", self.codes, f"decode failed on {len(self.failed)} "
                                                "instances")
        loop = asyncio.get_running_loop()
        until = loop.time() + retry.instance_grace_s
        while (inst := self.mesh.router.pick("decode", exclude=self.failed,
                                             adapter=self.req.lora_name)) is None:
            if loop.time() >= until:
                raise gave_up("decode", self.codes, "no decode instance is available")
            await asyncio.sleep(retry.grace_poll_s)
        return inst

    async def _decode(self, inst: Instance, offloaded: bool) -> AsyncIterator[TokenDelta]:
        """One decode session: stream what it generates; ``self.outcome`` says how it
        ended (FAILED: the caller migrates)."""
        self.outcome = Outcome.FAILED
        span = self.trace.child("decode", inst, {"pdmesh.attempt": len(self.failed),
                                                 "pdmesh.carried_tokens": len(self.tokens)})
        call = self._call(f"{self.req.request_id}-d{len(self.failed)}r{self.hand_backs}",
                          self.tokens, self.block_keys, self.trace.carrier(span))
        router = self.mesh.router
        deltas = self.mesh.decode.generate(inst, call, self.mesh.retry.timeout_s,
                                           stall=(self.mesh.retry.stall_timeout_s,
                                                  lambda: router.listed(inst.id)))
        first = offloaded
        try:
            async for delta in deltas:
                if delta.finish_reason == "recomputed":  # out of KV there (decode's
                    self.outcome = Outcome.HANDED_BACK    # recompute scheduler)
                    return
                if first:  # its first token: the offloaded prompt is done there
                    self.mesh.router.answered(inst, self.req.prompt)
                    first = False
                else:
                    delta.num_cached_tokens = 0  # the prompt's count came with prefill
                self.tokens += delta.token_ids
                yield delta
                if delta.finish_reason:
                    self.outcome = Outcome.FINISHED
                    return
        except CallFailed as e:
            await self._decode_failed(inst, e)
        finally:
            if first:  # an offloaded prompt that ended before its first token
                self.mesh.router.answered(inst, self.req.prompt)
            await deltas.aclose()  # aborts the request on decode when the client left
            self.trace.end(span, {"pdmesh.outcome": self.outcome.value})

    async def _decode_failed(self, inst: Instance, e: CallFailed) -> None:
        """Migrate (the caller picks another instance after the backoff), or give up."""
        if not self.mesh.retry.retryable(e.code):
            status = http_status(e.code)
            raise MeshError((e.details or "invalid request") if status == 400
                            else f"decode failed: {e}", status) from e
        log.warning("request %s: decode %s failed (%s); continuing elsewhere after %d "
                    "tokens", self.req.request_id, inst.address, e.code.name,
                    len(self.tokens))
        self.failed.add(inst.id)
        self.codes.append(e.code)
        self.mesh.events.retried("decode")
        if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:  # it had started there
            self.mesh.events.migrated.inc()
        self.mesh.router.forget()
        await asyncio.sleep(self.mesh.retry.backoff_s)

    async def _hand_back(self, inst: Instance) -> TokenDelta:
        """Re-prefill prompt + tokens so far; the client's stream goes on as if nothing
        happened."""
        self.hand_backs += 1
        self.mesh.events.handed_back.inc()
        if self.hand_backs > self.mesh.retry.max_hand_backs:
            raise MeshError(f"decode handed the request back {self.mesh.retry.max_hand_backs}"
                            " times (out of KV cache); retry later")
        log.info("request %s: handed back by decode %s after %d tokens; re-prefilling",
                 self.req.request_id, inst.address, len(self.tokens))
        hop = self.trace.child("recompute", None, {"pdmesh.carried_tokens": len(self.tokens)})
        try:
            first = await self._prefill(list(self.tokens), span=hop)
        finally:
            self.trace.end(hop)
        first.num_cached_tokens = 0  # the prompt's count came with the first prefill
        return first

    async def _mixed(self) -> AsyncIterator[TokenDelta]:
        """A mixed instance prefills and decodes in one engine: one stream, no pool. An
        instance that refuses the request at its queue limit is replaced by another."""
        refused: list[grpc.StatusCode] = []
        tried: set[str] = set()
        for _ in range(self.mesh.retry.prefill_attempts):
            inst = self.mesh.router.pick("mixed", exclude=tried, adapter=self.req.lora_name)
            if inst is None:
                break
            deltas = self.mesh.decode.generate(inst, self._call(self.req.request_id),
                                               self.mesh.retry.timeout_s)
            first = True
            try:
                async for delta in deltas:
                    if not first:
                        delta.num_cached_tokens = 0
                    first = False
                    yield delta
                return
            except CallFailed as e:
                if first and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refused.append(e.code)  # nothing ran there: another may take it
                    tried.add(inst.id)
                    continue
                raise MeshError(e.details or e.code.name, http_status(e.code)) from e
            finally:
                await deltas.aclose()
        raise gave_up("mixed", refused, "no instance is available")

    def _call(self, call_id: str, carried: list[int] | None = None,
              block_keys: list[str] | None = None,
              trace_context: dict[str, str] | None = None) -> Call:
        """A call for the request; one carrying tokens asks no prompt logprobs (they
        came with the first token, and the prompt's KV may then come from the pool)."""
        sampling = self.req.sampling
        if carried and sampling.prompt_logprobs is not None:
            sampling = dataclasses.replace(sampling, prompt_logprobs=None)
        return Call(call_id, self.req.prompt, sampling, self.req.priority,
                    list(carried or []), list(block_keys or []), trace_context or {},
                    self.req.lora_name, self.req.lora_path)


class NoTrace:
    """Tracing off: every span is None and costs nothing."""

    def child(self, name: str, inst: Instance | None, attributes: dict[str, Any],
              parent: Any = None) -> Any:
        return None

    def carrier(self, span: Any) -> dict[str, str]:
        return {}

    def end(self, span: Any, attributes: dict[str, Any] | None = None) -> None:
        pass


class JourneyTrace(NoTrace):
    """Child spans of the request's span for each call, and their W3C context to send."""

    ROUTES = {"prefill": "least estimated TTFT", "decode": "fewest KV blocks in use"}

    def __init__(self, tracing: Any, span: Any):
        self.tracing = tracing
        self.span = span

    def child(self, name: str, inst: Instance | None, attributes: dict[str, Any],
              parent: Any = None) -> Any:
        if inst is not None:
            attributes = {**attributes, "pdmesh.instance": inst.id,
                          "pdmesh.address": inst.address,
                          "pdmesh.route": self.ROUTES.get(name, "")}
        return self.tracing.start(name, self.tracing.context_of(parent or self.span),
                                  kind="client", attributes=attributes)

    def carrier(self, span: Any) -> dict[str, str]:
        return self.tracing.inject(self.tracing.context_of(span)) if span is not None else {}

    def end(self, span: Any, attributes: dict[str, Any] | None = None) -> None:
        if span is not None:
            for k, v in (attributes or {}).items():
                span.set_attribute(k, v)
            span.end()
