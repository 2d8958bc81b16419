"""Continuous batching with chunked prefill and recompute preemption.

There are no prefill or decode phases: each request has ``num_computed_tokens`` of its
``num_tokens`` in the cache, and every step hands out a token budget
(``max_num_batched_tokens``) to close those gaps; a long prompt simply takes several
steps (chunked prefill). ``schedule()`` runs these passes, in order, over one ``_Step``
(the budget left, the output being built, the running requests given tokens so far):

    loads       pool reads that ended off the step join the running (``PromptLoads``)
    plan        a DP balancer's (DyntraLB) plan: it pauses running requests, and while
                it is in force only the candidates it names are admitted
    running     each running request its next tokens, in order: a prompt's next chunk,
                or one token to decode and the drafts it verifies (speculative
                decoding) where they fit
    preemption  a running request that cannot get a block preempts the policy's victim:
                its blocks are freed and it waits to be recomputed (or, recompute
                elsewhere, is handed back); memory is then tight: nothing new is admitted
    resume      requests whose KV is here, prefetched then paused (newest first), get a
                seat again
    admission   waiting requests, in the policy's order (the balancer's picks while its
                plan is in force), while seats (``max_num_seqs``) and blocks last; each
                takes its local prefix-cache hits, and what the KV pool holds beyond
                them is loaded, on the step or off it
    victims     under a priority policy with a preemption threshold (SGLang's), a
                waiting request that finds no seat or blocks preempts the running
                requests it outranks by more than the threshold

A paused request (DyntraLB) leaves the running set with its blocks kept (its seat is
free) and is admitted again ahead of the waiting queue.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pdmesh.shared.engine.block_manager import KVCacheManager, PrefixHit
from pdmesh.shared.engine.kv_connector import PoolConnector
from pdmesh.shared.engine.policy import SchedulingPolicy
from pdmesh.shared.engine.prompt_loads import PromptLoads
from pdmesh.shared.engine.request import Request, RequestStatus
from pdmesh.shared.engine.scheduler_lb import LoadBalancing
from pdmesh.shared.engine.spec_decode import Drafts

log = logging.getLogger(__name__)


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


@dataclass
class _Step:
    """What the passes of one ``schedule()`` share."""

    budget: int  # tokens still to hand out
    prompt_left: int  # ... of them to prompt chunks (rows computing more than one token)
    out: SchedulerOutput = field(default_factory=lambda: SchedulerOutput([], []))
    # id() of the running requests the running pass gave tokens (never its victims)
    scheduled: set[int] = field(default_factory=set)
    # while the balancer's plan is in force, the waiting requests it admits that are
    # still to be, in queue order; None: admission is free
    picks: list[Request] | None = None

    def take(self, req: Request, n: int, chunk: bool = False) -> None:
        """``req`` computes ``n`` tokens this step (``chunk``: of its prompt)."""
        self.out.requests.append(req)
        self.out.num_tokens.append(n)
        self.budget -= n
        if chunk:
            self.prompt_left -= n

    def chunk(self, left: int) -> tuple[int, bool]:
        """The tokens a request with ``left`` to compute gets, and whether they are a
        prompt chunk (more than one row; a decode row is never held back)."""
        n = min(left, self.budget)
        return (min(n, self.prompt_left), True) if left > 1 else (n, False)

    def drop(self, req: Request) -> None:
        """``req`` was preempted: out of the batch if it was in, its tokens back."""
        for i, r in enumerate(self.out.requests):
            if r is req:  # scheduled earlier this step: its tokens go back
                del self.out.requests[i]
                n = self.out.num_tokens.pop(i)
                self.budget += n
                if n > 1 and req not in self.out.drafts:
                    self.prompt_left += n
                self.out.drafts.pop(req, None)
                break
        self.out.preempted.append(req)


@dataclass(frozen=True)
class _PromptSources:
    """Where a waiting request's prompt comes from besides computing it here: its first
    ``hit_tokens`` from the local prefix cache (``cached``), the next ``pooled`` from the
    KV pool. ``fresh``: nothing computed yet, so it was looked up at all."""

    cached: PrefixHit = field(default_factory=PrefixHit)
    hit_tokens: int = 0
    pooled: int = 0
    fresh: bool = False


class Scheduler(LoadBalancing):
    def __init__(self, kv: KVCacheManager, policy: SchedulingPolicy, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 connector: PoolConnector | None = None, async_kv_load: bool = False,
                 kv_load_timeout_s: float | None = None):
        """``async_kv_load``: a request whose prompt comes from the pool is loaded on a
        helper thread while the running requests keep stepping; it joins the batch once
        its blocks are in (a step never waits for a pool read). A load still running
        after ``kv_load_timeout_s`` (plus its bytes at ``KV_LOAD_FLOOR_BYTES_PER_S``) is
        given up: the request computes its prompt here, in other blocks - the ones the
        read may still write into are held until it ends (``PromptLoads``)."""
        self.kv = kv
        self.connector = connector
        self.async_kv_load = async_kv_load and connector is not None
        self.loads = PromptLoads(kv, connector, kv_load_timeout_s or None)
        self.waiting = policy
        self.running: list[Request] = []
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # the prompt tokens (chunks of more than one row) a step computes at most, within
        # max_num_batched_tokens (None: that budget alone); an engine that keeps its steps
        # under a time budget (a decode instance) sets it before each schedule()
        self.prompt_cap: int | None = None
        self.max_model_len = max_model_len
        self.preemptions = 0  # since start, for metrics and tests
        self.priority_preemptions = 0  # ... of them, to admit a request of higher priority
        # DyntraLB: paused requests (out of ``running``, blocks kept; in pause order), the
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
        # vLLM's kv_load_failure_policy "fail": a request whose pool or tier read failed
        # (or was given up) ends with an error (FINISHED_ERROR, reported as a hand-back
        # is) instead of computing its prompt here
        self.fail_on_load_error = False
        self.load_failures = 0  # requests so ended, since start
        self.prefix_queries = 0  # prompt tokens looked up in the local prefix cache
        self.prefix_hits = 0  # ... and found there
        # LoRA: the adapters a step may run at most (the device slots; 0: no LoRA). A
        # waiting request whose adapter would be one too many waits, the others go by.
        self.max_loras = 0

    @property
    def loading(self) -> dict[int, tuple[Request, Future, int, bool, float]]:
        """Requests whose pool reads run off the step (``PromptLoads.loading``)."""
        return self.loads.loading

    @property
    def kv_load_timeouts(self) -> int:
        """Pool reads given up past their deadline, since start."""
        return self.loads.timeouts

    @property
    def has_unfinished(self) -> bool:
        return (bool(self.running) or len(self.waiting) > 0 or bool(self.loading)
                or bool(self.paused) or bool(self.ready))

    @property
    def _seats_taken(self) -> int:
        return len(self.running) + self.loads.seats

    def add(self, request: Request) -> None:
        self.waiting.add(request)

    def schedule(self) -> SchedulerOutput:
        """The next step's work: the passes of the module docstring, in order."""
        if self.loads.pending:
            self._finish_loads()
        if self._lb_planned:
            self._apply_lb_plan()
        budget = self.max_num_batched_tokens
        step = _Step(budget, budget if self.prompt_cap is None else min(budget, self.prompt_cap))
        self._schedule_running(step)
        if step.out.preempted:
            return step.out  # memory is tight: admit nothing new this step
        self._resume_paused(step)
        reorder = getattr(self.waiting, "reorder", None)
        if reorder is not None and self._lb_admit is None and len(self.waiting) > 1:
            reorder(self._cached_tokens)  # (SGLang's lpm, lof, random)
        self._admit_waiting(step)
        if step.out.is_empty and self.loading:  # nothing to compute but loads: wait a little
            self.loads.wait(timeout=0.005)
        return step.out

    # -- the running pass: chunks, decodes and drafts; preemption -----------------------
    def _schedule_running(self, step: _Step) -> None:
        """Each running request, in order, its next tokens while the budget lasts."""
        i = 0
        while i < len(self.running) and step.budget > 0:
            if self._schedule_one(self.running[i], step):
                i += 1
            # else it was preempted itself: self.running[i] is the next one

    def _schedule_one(self, req: Request, step: _Step) -> bool:
        """Blocks for ``req``'s next tokens (and drafts to verify, where they fit), by
        preempting the policy's victims if it must. False if ``req`` was the victim."""
        n, chunk = step.chunk(req.num_tokens - req.num_computed_tokens)
        if n == 0:
            return True  # a prompt chunk, and none fits this step: the next one
        drafts = self._drafts_to_verify(req, n, step.budget)
        if drafts is not None and not self.kv.allocate(req, n + len(drafts.tokens)):
            drafts = None  # no room for them: one token, as without speculation
        if drafts is None and not self.kv.allocate(req, n) \
                and not self._make_room(req, n, step):
            return False
        if drafts is not None:
            step.out.drafts[req] = drafts
            n += len(drafts.tokens)
        step.take(req, n, chunk)
        step.scheduled.add(id(req))
        return True

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

    def _make_room(self, req: Request, n: int, step: _Step) -> bool:
        """Allocate for ``req``, preempting victims until it fits. False if ``req`` went."""
        while not self.kv.allocate(req, n):
            candidates = [r for r in self.running if id(r) not in step.scheduled]
            victim = self.waiting.victim(candidates)
            self._preempt(victim, step)
            if victim is req:
                return False
        return True

    # -- admission: waiting requests, prefix-cache and pool hits; victims ---------------
    def _admit_waiting(self, step: _Step) -> None:
        """Waiting requests in the policy's order (only the balancer's picks while its
        plan is in force) while the budget lasts, up to the first that does not fit."""
        chosen = self._lb_admit
        step.picks = None if chosen is None else [r for r in self.waiting if id(r) in chosen]
        set_aside: list[Request] = []  # adapters over max_loras: waiting, in their order
        while step.budget > 0:
            req = self._next_waiting(step)
            if req is not None and step.picks is None and self._lora_full(req):
                self.waiting.remove(req)
                set_aside.append(req)
                continue
            if req is None or not self._admit(req, step):
                break
        for req in reversed(set_aside):
            self.waiting.readd(req)

    def _lora_full(self, req: Request) -> bool:
        """``req`` runs an adapter the running requests do not, and they run
        ``max_loras`` already."""
        if req.lora is None or not self.max_loras:
            return False
        active = {r.lora.lora_name for r in (*self.running, *self.paused,
                                             *(e[0] for e in self.loading.values()))
                  if r.lora is not None}
        return req.lora.lora_name not in active and len(active) >= self.max_loras

    def _next_waiting(self, step: _Step) -> Request | None:
        """The next to admit: the policy's, or the balancer's next pick; None: no more."""
        if step.picks is None:
            return self.waiting.peek() if len(self.waiting) else None
        return step.picks[0] if step.picks else None

    def _admit(self, req: Request, step: _Step) -> bool:
        """A seat for ``req`` and blocks for its prompt past the local prefix-cache hits
        (what the pool supplies, then the step's share of the rest), preempting running
        requests it outranks where it must; then it runs, or waits for its pool load.
        False if it does not fit: it stays waiting, and the pass ends."""
        full = self._seats_taken >= self.max_num_seqs
        victims = None
        if full:  # a seat only by preempting (never for a balancer's pick)
            victims = self.waiting.outranked(req, self.running) if step.picks is None else None
            if not victims:
                return False
        src = self._look_up_prompt(req)
        n, chunk = step.chunk(req.num_tokens - req.num_computed_tokens - src.hit_tokens
                              - src.pooled)
        later = bool(src.pooled) and self.async_kv_load
        if n == 0 and chunk and not later:
            return False  # its prompt is computed here and no chunk fits this step
        need = src.pooled + n
        # blocks still loading are made findable by prefix only once they are in
        if full or not self.kv.allocate(req, need, src.cached, register=not later):
            # no seat or no blocks: it may preempt running requests it outranks
            if (step.picks is not None
                    or not self._preempt_outranked(req, full, need, src.cached, step, victims)
                    or not self.kv.allocate(req, need, src.cached, register=not later)):
                return False
        self._take_waiting(req, step)
        self._take_hits(req, src)
        if later:
            self.loads.start(req, src.hit_tokens, src.pooled, seated=True)
            return True  # it joins the batch when its blocks are in
        loaded = not src.pooled or self.loads.load_now(req, src.hit_tokens, src.pooled)
        self._start_running(req)
        if not loaded and self.fail_on_load_error:
            self._fail_load(req)
            return True
        step.take(req, n, chunk)
        return True

    def _cached_tokens(self, req: Request) -> int:
        """Prompt tokens of a waiting ``req`` the local prefix cache holds (none for one
        that computed some already)."""
        if req.num_computed_tokens or req.computes_whole_prompt:
            return 0
        return self.kv.find_cached_prefix(req).num_blocks * self.kv.block_size

    def _look_up_prompt(self, req: Request) -> _PromptSources:
        """``req``'s prompt in the local prefix cache, and past its hits in the pool.
        Only a fresh prompt is looked up (a prompt whose logprobs are asked, or that
        MEAN or CLS pooling reads, is computed whole: no hits, as vLLM's), and the pool
        only if it has not been given up on."""
        fresh = req.num_computed_tokens == 0 and not req.computes_whole_prompt
        if not fresh:
            return _PromptSources()
        cached = self.kv.find_cached_prefix(req)
        hit_tokens = cached.num_blocks * self.kv.block_size
        # tokens the KV pool can supply beyond the local hits (loaded, not computed)
        pooled = (self.connector.loadable_tokens(req, hit_tokens)
                  if self.connector is not None and not req.pool_gave_up else 0)
        return _PromptSources(cached, hit_tokens, pooled, fresh=True)

    def _take_waiting(self, req: Request, step: _Step) -> None:
        """``req``, the next admitted, leaves the waiting queue (and the picks)."""
        if step.picks is None:
            self.waiting.pop()
        else:
            step.picks.pop(0)
            self.waiting.remove(req)

    def _take_hits(self, req: Request, src: _PromptSources) -> None:
        """The prefix-cache hits of an admitted request count as computed (and in the
        hit rate, if it was looked up)."""
        req.num_computed_tokens += src.hit_tokens
        if src.fresh:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += src.hit_tokens

    def _preempt_outranked(self, req: Request, seat: bool, num_tokens: int,
                           cached: PrefixHit, step: _Step,
                           victims: list[Request] | None = None) -> bool:
        """SGLang's priority preemption: free a seat (``seat``) and the blocks ``req``
        lacks for ``num_tokens`` by preempting the running requests it outranks (the
        policy's ``outranked``), the fewest that suffice; their tokens this step go back
        to the budget. False, preempting nothing, if they do not suffice. ``victims``:
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
            return False
        for victim in chosen:
            self._preempt(victim, step)
            self.priority_preemptions += 1
        log.info("request %s (priority %d) preempted %d running: %s", req.request_id,
                 req.priority, len(chosen), ", ".join(v.request_id for v in chosen))
        return True

    # -- joining the running: pool loads done off the step (async_kv_load) --------------
    def _finish_loads(self) -> None:
        """Requests whose pool loads are done join the running (in the order they were
        admitted; a prefetch waits in ``ready`` for the plan to admit it); one whose
        load was given up waits again, to compute its prompt here."""
        done, given_up = self.loads.collect()
        for req in given_up:
            self.waiting.readd(req)
            if self.fail_on_load_error:
                self._fail_load(req)
        for req, seated, loaded in done:
            if seated:
                self._start_running(req)
            else:
                self.ready.append(req)
            if not loaded and self.fail_on_load_error:
                self._fail_load(req)

    def _fail_load(self, req: Request) -> None:
        """kv_load_failure_policy "fail": the request ends with an error, its blocks
        back, reported with the hand-backs."""
        log.warning("request %s: its KV read failed; failing it (kv_load_failure_policy "
                    "fail)", req.request_id)
        self.finish(req, RequestStatus.FINISHED_ERROR)
        self.load_failures += 1
        self.handed_back.append(req)

    def _start_running(self, req: Request) -> None:
        """An admitted request joins the running (what it brought counts as cached)."""
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed_tokens
        if req.scheduled_time is None:
            req.scheduled_time = time.monotonic()
        req.transition(RequestStatus.RUNNING)
        self.running.append(req)

    def _resume_paused(self, step: _Step) -> None:
        """The resume pass: requests whose KV is here first, prefetched then paused (the
        newest pause first): a seat and their next tokens' blocks."""
        chosen = self._lb_admit
        for req in self._resumable():
            if step.budget <= 0 or self._seats_taken >= self.max_num_seqs:
                break
            if chosen is not None and id(req) not in chosen:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, step.budget)
            if not self.kv.allocate(req, n):
                if not self.running and not self.loading:
                    self._preempt(req, step)  # nothing else could ever free the blocks
                break
            if req.status is RequestStatus.PAUSED:
                self._back_to_running(req)
            else:
                self.ready.remove(req)
                self._start_running(req)
            step.take(req, n)

    # -- leaving the running: preemption, sampled tokens, finishing ---------------------
    def _preempt(self, req: Request, step: _Step) -> None:
        """``req`` loses its blocks (and its place in this step's batch): it waits to be
        recomputed, or is handed back (recompute elsewhere)."""
        step.drop(req)
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
            ends_later = bool(req.eos_token_ids) and not sp.ignore_eos
            if req.grammar.done and not ends_later and token not in req.stop_ids:
                # complete, and no end of sequence to come (none, or ignored): stop here
                return RequestStatus.FINISHED_STOPPED
            # (complete otherwise: the end of sequence, the one token the grammar allows
            # now, is sampled next and ends it, counted, with its logprobs, as vLLM's)
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
