"""The scheduler's DyntraLB side (pdmesh.shared.engine.dyntralb plans, the scheduler
carries the plans out): pausing a running request with its KV kept, the admission
candidates a planning step's snapshot lists (with vLLM-Ascend's KV prefetch), a plan's
moves applied at the next step, and the resume pass that seats paused and prefetched
requests again. A mixin of ``Scheduler``, whose state (``running``, ``paused``,
``ready``, ``waiting``, ``kv``, ``loads``, the plan) it reads and writes."""

from __future__ import annotations

from typing import Any

from pdmesh.shared.engine.request import Request, RequestStatus


class LoadBalancing:
    """Pausing and plans (DyntraLB)."""

    running: list[Request]
    paused: list[Request]
    ready: list[Request]
    waiting: Any
    kv: Any
    loads: Any

    def lb_candidates(self) -> list[Request]:
        """What this rank could admit, in the order it would (vLLM-Ascend's schedule
        order): prefetched requests whose KV is in (its skipped-waiting queue), paused
        ones newest first (each pause goes to the head of its waiting queue), then the
        waiting queue, less the requests past the prefetch limit (``prefetch_kv``)."""
        return [*self._resumable(), *(r for r in self.waiting if id(r) not in self._not_ready)]

    def _resumable(self) -> list[Request]:
        """Requests whose KV is here, in admission order: prefetched, then paused (the
        newest pause first)."""
        return [*self.ready, *reversed(self.paused)]

    def collect_loads(self) -> None:
        """Pool loads done since the last step join now (a planning step's snapshot sees
        them, as vLLM-Ascend's refresh of its blocked requests does)."""
        if self.loads.pending:
            self._finish_loads()

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
            if req.pool_gave_up or req.computes_whole_prompt:
                continue  # nothing to read (given up, or computed whole): as it is
            if looked >= limit:
                self._not_ready.add(id(req))
                continue
            looked += 1
            src = self._look_up_prompt(req)
            if not src.pooled:
                continue  # nothing to read: a candidate as it is
            if not self.kv.allocate(req, src.pooled, src.cached, register=False):
                self._not_ready.add(id(req))
                continue
            self.waiting.remove(req)
            self._take_hits(req, src)
            self.loads.start(req, src.hit_tokens, src.pooled, seated=False)

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
