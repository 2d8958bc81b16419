"""Continuous batching with chunked prefill and recompute preemption.

There are no prefill or decode phases: each request has ``num_computed_tokens`` of its
``num_tokens`` in the cache, and every step hands out a token budget
(``max_num_batched_tokens``) to close those gaps, running requests first, then waiting
ones while seats (``max_num_seqs``) and blocks last. A long prompt simply takes several
steps (chunked prefill). When a running request cannot get a block, the policy's
victim is preempted: its blocks are freed and it waits to be recomputed. Under a
priority policy with a preemption threshold (SGLang's), a waiting request that finds no
seat or blocks preempts the running requests it outranks by more than the threshold.

A DP balancer (DyntraLB) may pause running requests: a paused request leaves the
running set with its blocks kept (its seat is free) and is admitted again ahead of the
waiting queue; while the balancer's plan is in force only the candidates it names are
admitted.
"""

from __future__ import annotations

import logging
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pdmesh.shared.engine.block_manager import KVCacheManager, PrefixHit
from pdmesh.shared.engine.kv_connector import PoolConnector
from pdmesh.shared.engine.policy import SchedulingPolicy
from pdmesh.shared.engine.request import Request, RequestStatus
from pdmesh.shared.engine.spec_decode import Drafts

log = logging.getLogger(__name__)

KV_LOAD_THREADS = 4  # pool reads at once (each a batch of one request's blocks)
# a read's timeout grows with its size: --kv-load-timeout plus the time it takes at this
# rate (a slow TCP link; RDMA and HCCS move the same in a small fraction of it)
KV_LOAD_FLOOR_BYTES_PER_S = 256 << 20


@dataclass
class SchedulerOutput:
    """One step's work, in batch order."""

    requests: list[Request]  # scheduled this step
    num_tokens: list[int]  # new tokens computed for each, same order
    preempted: list[Request] = field(default_factory=list)  # lost their blocks this step
    # speculative decoding: a scheduled request -> the drafts it verifies this step
    # (counted in its ``num_tokens``: its last token plus the drafts)
    drafts: dict[Request, Drafts] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, kv: KVCacheManager, policy: SchedulingPolicy, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 connector: PoolConnector | None = None, async_kv_load: bool = False,
                 kv_load_timeout_s: float | None = None):
        """``async_kv_load``: a request whose prompt comes from the pool is loaded on a
        helper thread while the running requests keep stepping; it joins the batch once
        its blocks are in (a step never waits for a pool read). A load still running
        after ``kv_load_timeout_s`` (plus its bytes at ``KV_LOAD_FLOOR_BYTES_PER_S``) is
        given up: the request computes its prompt here, in other blocks - the ones the
        read may still write into are held until it ends."""
        self.kv = kv
        self.connector = connector
        self.async_kv_load = async_kv_load and connector is not None
        self.kv_load_timeout_s = kv_load_timeout_s or None
        # id(request) -> (request, its load, the tokens it brings, whether it holds a
        # seat: a DyntraLB prefetch does not until the plan admits it, when it is given
        # up)
        self.loading: dict[int, tuple[Request, Future, int, bool, float]] = {}
        self._loader: ThreadPoolExecutor | None = None
        self._abandoned: list[tuple[Future, list]] = []  # (given-up load, blocks it holds)
        self.kv_load_timeouts = 0  # since start, for metrics and tests
        self.waiting = policy
        self.running: list[Request] = []
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.preemptions = 0  # since start, for metrics and tests
        self.priority_preemptions = 0  # ... of them, to admit a request of higher priority
        # DyntraLB: paused requests (out of ``running``, blocks kept; oldest first), the
        # candidates its last snapshot listed, the plan to apply at the next schedule,
        # and the requests that plan lets in (None: any).
        self.paused: list[Request] = []
        self.ready: list[Request] = []  # prefetched from the pool, waiting for a seat
        self._not_ready: set[int] = set()  # beyond this step's prefetch limit
        self.lb_snapshot: list[Request] = []
        self._lb_plan: Any = None
        self._lb_planned = False
        self._lb_admit: set[int] | None = None
        self.pauses = self.resumes = 0  # since start, for metrics and tests
        # vLLM-Ascend's recompute scheduler (decode instances): a request that must give
        # its blocks up is handed back (FINISHED_RECOMPUTED, collected in ``handed_back``
        # until the engine reports it) instead of waiting here to be recomputed.
        self.recompute_elsewhere = False
        self.handed_back: list[Request] = []
        self.recomputed = 0  # requests handed back, since start
        self.prefix_queries = 0  # prompt tokens looked up in the local prefix cache
        self.prefix_hits = 0  # ... and found there

    @property
    def has_unfinished(self) -> bool:
        return (bool(self.running) or len(self.waiting) > 0 or bool(self.loading)
                or bool(self.paused) or bool(self.ready))

    @property
    def _seats_taken(self) -> int:
        return len(self.running) + sum(seat for _, _, _, seat, _ in self.loading.values())

    def add(self, request: Request) -> None:
        self.waiting.add(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [])
        if self.loading or self._abandoned:
            self._finish_loads()
        if self._lb_planned:
            self._apply_lb_plan()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = self._drafts_to_verify(req, n, budget)
            if drafts is not None and not self.kv.allocate(req, n + len(drafts.tokens)):
                drafts = None  # no room for them: one token, as without speculation
            if drafts is None and not self.kv.allocate(req, n) \
                    and not self._make_room(req, n, out, scheduled):
                continue  # req itself was preempted; self.running[i] is the next one
            if drafts is not None:
                out.drafts[req] = drafts
                n += len(drafts.tokens)
            out.requests.append(req)
            out.num_tokens.append(n)
            scheduled.add(id(req))
            budget -= n
            i += 1
        if out.preempted:
            return out  # memory is tight: admit nothing new this step
        budget = self._resume_paused(out, budget)
        chosen = self._lb_admit
        picks = None if chosen is None else [r for r in self.waiting if id(r) in chosen]
        while budget > 0 and (len(self.waiting) if picks is None else picks):
            req = self.waiting.peek() if picks is None else picks[0]
            full = self._seats_taken >= self.max_num_seqs
            victims = self.waiting.outranked(req, self.running) if full and picks is None \
                else None
            if full and not victims:
                break
            # (a prompt whose logprobs are asked is computed whole: no hits, as vLLM's)
            fresh = req.num_computed_tokens == 0 and not req.wants_prompt_logprobs
            cached = self.kv.find_cached_prefix(req) if fresh else PrefixHit()
            hit_tokens = cached.num_blocks * self.kv.block_size
            # tokens the KV pool can supply beyond the local hits (loaded, not computed)
            pooled = (self.connector.loadable_tokens(req, hit_tokens)
                      if fresh and self.connector is not None and not req.pool_gave_up
                      else 0)
            n = min(req.num_tokens - req.num_computed_tokens - hit_tokens - pooled, budget)
            later = bool(pooled) and self.async_kv_load
            # blocks still loading are made findable by prefix only once they are in
            if full or not self.kv.allocate(req, pooled + n, cached, register=not later):
                # no seat or no blocks: it may preempt running requests it outranks
                given_back = (None if picks is not None else
                              self._preempt_outranked(req, full, pooled + n, cached, out,
                                                      victims))
                if given_back is None or not self.kv.allocate(req, pooled + n, cached,
                                                              register=not later):
                    break
                budget += given_back
            if picks is None:
                self.waiting.pop()
            else:
                picks.pop(0)
                self.waiting.remove(req)
            req.num_computed_tokens += hit_tokens
            if fresh:
                self.prefix_queries += req.num_tokens
                self.prefix_hits += hit_tokens
            if later:
                self._start_load(req, hit_tokens, pooled)
                continue  # it joins the batch when its blocks are in
            if pooled:
                assert self.connector is not None
                t0 = time.monotonic()
                loaded = self.connector.load(
                    req, [self.kv.block_ids(req, g) for g in range(len(self.kv.groups))],
                    hit_tokens, pooled)
                req.kv_get_time = (t0, time.monotonic())
                if loaded:
                    req.num_computed_tokens += pooled
                else:  # recompute from the local hits; nothing unfilled stays findable
                    self.kv.forget_from(req, hit_tokens // self.kv.block_size)
            self._start_running(req)
            out.requests.append(req)
            out.num_tokens.append(n)
            budget -= n
        if out.is_empty and self.loading:  # nothing to compute but loads: wait a little
            futures.wait([f for _, f, *_ in self.loading.values()], timeout=0.005,
                         return_when=futures.FIRST_COMPLETED)
        return out

    def _drafts_to_verify(self, req: Request, n: int, budget: int) -> Drafts | None:
        """The drafts ``req`` verifies this step (taken off it), cut to what fits: the
        step's token budget, max_model_len, and max_tokens (the drafts and the token
        after them must not run past it); None: it decodes one token."""
        drafts, req.drafts = req.drafts, None
        if drafts is None or not drafts.tokens or n != 1:
            return None
        room = min(len(drafts.tokens), budget - 1, self.max_model_len - req.num_tokens)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - req.num_output_tokens - 1)
        if room <= 0:
            return None
        return drafts.cut(room) if room < len(drafts.tokens) else drafts

    # -- pool loads off the step (async_kv_load) --------------------------------------------
    def _start_load(self, req: Request, hit_tokens: int, pooled: int,
                    seated: bool = True) -> None:
        assert self.connector is not None
        connector = self.connector
        tables = [list(self.kv.block_ids(req, g)) for g in range(len(self.kv.groups))]

        def load() -> bool:
            t0 = time.monotonic()
            try:
                return connector.load(req, tables, hit_tokens, pooled)
            finally:
                req.kv_get_time = (t0, time.monotonic())

        if self._loader is None:  # a few: one slow read must not hold the others up
            self._loader = ThreadPoolExecutor(KV_LOAD_THREADS, thread_name_prefix="kv-load")
        deadline = float("inf")
        if self.kv_load_timeout_s is not None:
            nbytes = -(-pooled // self.kv.block_size) * sum(g.value_bytes
                                                             for g in connector.groups)
            deadline = (time.monotonic() + self.kv_load_timeout_s
                        + nbytes / KV_LOAD_FLOOR_BYTES_PER_S)
        self.loading[id(req)] = (req, self._loader.submit(load), pooled, seated, deadline)

    def _finish_loads(self) -> None:
        """Requests whose pool loads are done join the running (in the order they were
        admitted; a prefetch waits in ``ready`` for the plan to admit it); a failed load
        leaves the prompt to compute here, an aborted request's blocks go back now that
        nothing writes them; a load past its timeout is given up."""
        if self._abandoned:
            still = []
            for fut, held in self._abandoned:
                if fut.done():
                    self.kv.unpin(held)
                else:
                    still.append((fut, held))
            self._abandoned = still
        now = time.monotonic()
        for key, (req, fut, pooled, seated, deadline) in list(self.loading.items()):
            if not fut.done():
                if now > deadline:
                    del self.loading[key]
                    self._give_up_load(req, fut)
                continue
            del self.loading[key]
            if req.is_finished:  # aborted while loading
                self.kv.free(req)
                continue
            try:
                loaded = fut.result()
            except Exception:  # noqa: BLE001 (a failed load is a recompute, not a crash)
                log.exception("request %s: pool load failed; recomputing", req.request_id)
                loaded = False
            if loaded:
                req.num_computed_tokens += pooled
            if seated:
                self._start_running(req)
            else:
                self.ready.append(req)

    def _give_up_load(self, req: Request, fut: Future) -> None:
        """The read is still running past its timeout (a peer stopped answering): its
        blocks stay held until it ends, and the request starts over without the pool."""
        self.kv_load_timeouts += 1
        log.warning("request %s: pool read still running after %.1f s; computing the "
                    "prompt here", req.request_id, self.kv_load_timeout_s)
        self._abandoned.append((fut, self.kv.pin(req)))
        self.kv.free(req)
        if req.is_finished:  # aborted while loading
            return
        req.num_computed_tokens = 0
        req.pool_gave_up = True
        self.waiting.readd(req)

    def _start_running(self, req: Request) -> None:
        """An admitted request joins the running (what it brought counts as cached)."""
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed_tokens
        if req.scheduled_time is None:
            req.scheduled_time = time.monotonic()
        req.transition(RequestStatus.RUNNING)
        self.running.append(req)

    def _make_room(self, req: Request, n: int, out: SchedulerOutput,
                   scheduled: set[int]) -> bool:
        """Allocate for ``req``, preempting victims until it fits. False if ``req`` went."""
        while not self.kv.allocate(req, n):
            candidates = [r for r in self.running if id(r) not in scheduled]
            victim = self.waiting.victim(candidates)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt_outranked(self, req: Request, seat: bool, num_tokens: int,
                           cached: PrefixHit, out: SchedulerOutput,
                           victims: list[Request] | None = None) -> int | None:
        """SGLang's priority preemption: free a seat (``seat``) and the blocks ``req``
        lacks for ``num_tokens`` by preempting the running requests it outranks (the
        policy's ``outranked``), the fewest that suffice. None, preempting nothing, if
        they do not; else the step's tokens the preempted had been given. ``victims``:
        the policy's answer, when the caller has it already."""
        short = self.kv.shortfall(req, num_tokens, cached)
        chosen: list[Request] = []
        if victims is None:
            victims = self.waiting.outranked(req, self.running)
        for victim in victims:
            if not seat and not any(short):
                break
            chosen.append(victim)
            seat = False
            short = [max(0, s - r) for s, r in zip(short, self.kv.releasable(victim),
                                                   strict=True)]
        if seat or any(short) or not chosen:
            return None
        given_back = 0
        for victim in chosen:
            for i, r in enumerate(out.requests):
                if r is victim:  # scheduled earlier this step: its tokens go back
                    del out.requests[i]
                    given_back += out.num_tokens.pop(i)
                    out.drafts.pop(victim, None)
                    break
            self._preempt(victim)
            out.preempted.append(victim)
            self.priority_preemptions += 1
        log.info("request %s (priority %d) preempted %d running: %s", req.request_id,
                 req.priority, len(chosen), ", ".join(v.request_id for v in chosen))
        return given_back

    # -- pausing and plans (DyntraLB) ---------------------------------------------------
    def lb_candidates(self) -> list[Request]:
        """What this rank could admit, in the order it would: paused and prefetched
        requests (their KV is here), then the waiting queue, less the requests past the
        prefetch limit (``prefetch_kv``)."""
        return [*self.paused, *self.ready,
                *(r for r in self.waiting if id(r) not in self._not_ready)]

    def prefetch_kv(self, limit: int) -> None:
        """vLLM-Ascend's DyntraLB prefetch: start the pool reads of up to ``limit`` fresh
        waiting requests, without seats; they become candidates once their KV is in.
        Fresh requests past the limit are not candidates this step (only requests whose
        KV is ready are admitted while a plan is in force)."""
        self._not_ready = set()
        if not (self.async_kv_load and self.connector is not None):
            return
        looked = 0
        for req in list(self.waiting):
            if req.num_computed_tokens:
                continue  # its KV is here already
            if req.pool_gave_up or req.wants_prompt_logprobs:
                continue  # nothing to read (given up, or computed whole): as it is
            if looked >= limit:
                self._not_ready.add(id(req))
                continue
            looked += 1
            cached = self.kv.find_cached_prefix(req)
            hit_tokens = cached.num_blocks * self.kv.block_size
            pooled = self.connector.loadable_tokens(req, hit_tokens)
            if not pooled:
                continue  # nothing to read: a candidate as it is
            if not self.kv.allocate(req, pooled, cached, register=False):
                self._not_ready.add(id(req))
                continue
            self.waiting.remove(req)
            req.num_computed_tokens += hit_tokens
            self.prefix_queries += req.num_tokens
            self.prefix_hits += hit_tokens
            self._start_load(req, hit_tokens, pooled, seated=False)

    def set_lb_plan(self, moves: Any) -> None:
        """The balancer's moves for the next step (None: no plan, admission is free):
        ``moves.out`` sizes to pause, ``moves.into`` sizes to admit, ``moves.freeze``."""
        self._lb_plan = moves
        self._lb_planned = True

    def _apply_lb_plan(self) -> None:
        """Pause the earliest running request of each ``out`` size; admit, of the
        candidates the snapshot listed, the first of each ``in`` size (none if frozen)."""
        moves, self._lb_plan, self._lb_planned = self._lb_plan, None, False
        if moves is None:
            self._lb_admit = None
            return
        out = list(moves.out)
        for req in list(self.running):
            size = self.kv.blocks_for(req.num_tokens)
            if size in out:
                out.remove(size)
                self.pause(req.request_id)
        into = [] if moves.freeze else list(moves.into)
        chosen = set()
        for req in self.lb_snapshot:
            size = self.kv.blocks_for(req.num_tokens)
            if size in into and req.status in (RequestStatus.WAITING, RequestStatus.PAUSED):
                into.remove(size)
                chosen.add(id(req))
        self._lb_admit = chosen

    def _resume_paused(self, out: SchedulerOutput, budget: int) -> int:
        """Requests whose KV is here first, paused (oldest first) then prefetched: a
        seat and their next tokens' blocks."""
        chosen = self._lb_admit
        for req in [*self.paused, *self.ready]:
            if budget <= 0 or self._seats_taken >= self.max_num_seqs:
                break
            if chosen is not None and id(req) not in chosen:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate(req, n):
                if not self.running and not self.loading:
                    self._preempt(req)  # nothing else could ever free the blocks
                    out.preempted.append(req)
                break
            if req.status is RequestStatus.PAUSED:
                self._back_to_running(req)
            else:
                self.ready.remove(req)
                self._start_running(req)
            out.requests.append(req)
            out.num_tokens.append(n)
            budget -= n
        return budget

    def pause(self, request_id: str) -> bool:
        """Take a running request out of the running set, its blocks kept."""
        req = next((r for r in self.running if r.request_id == request_id), None)
        if req is None:
            return False
        self.running.remove(req)
        req.transition(RequestStatus.PAUSED)
        self.paused.append(req)
        self.pauses += 1
        return True

    def _back_to_running(self, req: Request) -> None:
        self.paused.remove(req)
        req.transition(RequestStatus.RUNNING)
        self.running.append(req)
        self.resumes += 1

    def _preempt(self, req: Request) -> None:
        if self.recompute_elsewhere:
            self.finish(req, RequestStatus.FINISHED_RECOMPUTED)
            self.preemptions += 1
            self.recomputed += 1
            self.handed_back.append(req)
            return
        if req.status is RequestStatus.PAUSED:
            self.paused.remove(req)
        elif req.status is RequestStatus.WAITING:  # prefetched
            self.ready.remove(req)
        else:
            self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.drafts = None
        req.num_preemptions += 1
        self.preemptions += 1
        if req.status is not RequestStatus.WAITING:
            req.transition(RequestStatus.WAITING)
        self.waiting.readd(req)

    def update(self, out: SchedulerOutput, sampled: dict[int, Any]) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish what stopped.

        ``sampled`` maps a position in ``out.requests`` to its new token, or to its list
        of tokens (a request that verified drafts: the kept ones, then the target's);
        only requests whose last known token was computed this step have any. A list is
        cut, in place, after a token that finished its request; the positions of the
        rejected drafts are not computed, and the blocks past the request's tokens go
        back. Returns the finished.
        """
        finished = []
        for idx, (req, n) in enumerate(zip(out.requests, out.num_tokens, strict=True)):
            tokens = sampled.get(idx)
            drafts = out.drafts.get(req)
            if drafts is not None and tokens is not None:
                n -= len(drafts.tokens) - (len(tokens) - 1)  # the rejected positions
            req.num_computed_tokens += n
            if tokens is None:
                continue
            many = isinstance(tokens, list)
            for j, token in enumerate(tokens if many else [tokens]):
                req.append_token(token)
                if req.first_token_time is None:
                    req.first_token_time = time.monotonic()
                status = self.stop_status(req, token)
                if status is not None:
                    if many:
                        del tokens[j + 1:]
                    self.finish(req, status)
                    finished.append(req)
                    break
            if drafts is not None and not req.is_finished:
                self.kv.trim(req, req.num_tokens)
        return finished

    def stop_status(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        num_output = req.num_output_tokens
        if req.grammar is not None:
            req.grammar.sync(req.output_token_ids)
            if req.grammar.error is not None:  # (logged by the grammar)
                return RequestStatus.FINISHED_ERROR
            if req.grammar.done:  # complete: only the end of sequence could follow
                return RequestStatus.FINISHED_STOPPED
        if token in req.stop_ids and num_output >= sp.min_tokens:
            if token in sp.stop_token_ids or token != req.eos_token_ids[0]:
                # (vLLM: the model's end of sequence gives no reason; generation_config's
                # other ids are stop ids, reported as the stop token that ended it)
                req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and num_output >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Stop a request wherever it is and give its blocks back."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.PAUSED:
            self.paused.remove(req)
        elif req.status is RequestStatus.WAITING:
            if id(req) in self.loading:  # its blocks go back once the load is done
                req.transition(status)
                return
            if any(r is req for r in self.ready):
                self.ready.remove(req)
            else:
                self.waiting.remove(req)
        req.transition(status)
        self.kv.free(req)
