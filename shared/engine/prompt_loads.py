"""A waiting request's prompt read from the KV pool into its blocks, at admission.

The scheduler allocates the blocks first (for the tokens the pool holds past the local
prefix-cache hits), then the read runs:

    on the step   ``load_now``: inside ``schedule()``; what a read did not bring (blocks
                  gone: from the first missing one on) is computed here, and nothing
                  unfilled stays findable by prefix
    off the step  ``start`` (async_kv_load): on a helper thread while the running
                  requests keep stepping; the request is *loading* until ``collect``
                  finds its read done (it then runs, or, a DyntraLB prefetch, waits for
                  the plan to admit it), or past its deadline: given up, the request
                  starts over without the pool, and the blocks the read may still write
                  into stay pinned until it ends
"""

from __future__ import annotations

import logging
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

from pdmesh.shared.engine.block_manager import KVBlock, KVCacheManager
from pdmesh.shared.engine.kv_connector import PoolConnector
from pdmesh.shared.engine.request import Request

log = logging.getLogger(__name__)

KV_LOAD_THREADS = 4  # pool reads at once (each a batch of one request's blocks)
# a read's timeout grows with its size: --kv-load-timeout plus the time it takes at this
# rate (a slow TCP link; RDMA and HCCS move the same in a small fraction of it)
KV_LOAD_FLOOR_BYTES_PER_S = 256 << 20


class PromptLoads:
    def __init__(self, kv: KVCacheManager, connector: PoolConnector | None,
                 timeout_s: float | None):
        """``timeout_s``: how long a read off the step may run (plus its bytes at
        ``KV_LOAD_FLOOR_BYTES_PER_S``) before it is given up; None: no limit. Without a
        connector nothing is ever loaded (the scheduler asks the pool for nothing)."""
        self.kv = kv
        self.connector = connector
        self.timeout_s = timeout_s
        # id(request) -> (request, its load, the tokens it brings, whether it holds a
        # seat: a DyntraLB prefetch does not until the plan admits it, when it is given
        # up)
        self.loading: dict[int, tuple[Request, Future, int, bool, float]] = {}
        self._loader: ThreadPoolExecutor | None = None
        # (a given-up load, the blocks it may still write into)
        self._abandoned: list[tuple[Future, list[list[KVBlock]]]] = []
        self.timeouts = 0  # since start, for metrics and tests

    @property
    def pending(self) -> bool:
        """Reads still to collect: loading requests, or given-up reads still running."""
        return bool(self.loading) or bool(self._abandoned)

    @property
    def seats(self) -> int:
        """Seats held by loading requests (all but DyntraLB's prefetches)."""
        return sum(seat for _, _, _, seat, _ in self.loading.values())

    def load_now(self, req: Request, hit_tokens: int, pooled: int) -> bool:
        """Read ``pooled`` tokens past ``hit_tokens`` into ``req``'s blocks, on the step;
        whether they came."""
        assert self.connector is not None
        t0 = time.monotonic()
        loaded = self.connector.load(
            req, [self.kv.block_ids(req, g) for g in range(len(self.kv.groups))],
            hit_tokens, pooled)
        req.kv_get_time = (t0, time.monotonic())
        req.num_computed_tokens += loaded
        if loaded < pooled:  # compute from there; nothing unfilled stays findable
            self.kv.forget_from(req, (hit_tokens + loaded) // self.kv.block_size)
        return loaded == pooled

    def start(self, req: Request, hit_tokens: int, pooled: int, seated: bool) -> None:
        """Read ``pooled`` tokens past ``hit_tokens`` into ``req``'s blocks, off the step;
        ``seated``: it holds a seat while it loads."""
        assert self.connector is not None
        connector = self.connector
        tables = [list(self.kv.block_ids(req, g)) for g in range(len(self.kv.groups))]

        def load() -> int:
            t0 = time.monotonic()
            try:
                return connector.load(req, tables, hit_tokens, pooled, off_step=True)
            finally:
                req.kv_get_time = (t0, time.monotonic())

        if self._loader is None:  # a few: one slow read must not hold the others up
            self._loader = ThreadPoolExecutor(KV_LOAD_THREADS, thread_name_prefix="kv-load")
        deadline = float("inf")
        if self.timeout_s is not None:
            nbytes = -(-pooled // self.kv.block_size) * sum(g.value_bytes
                                                             for g in connector.groups)
            deadline = time.monotonic() + self.timeout_s + nbytes / KV_LOAD_FLOOR_BYTES_PER_S
        self.loading[id(req)] = (req, self._loader.submit(load), pooled, seated, deadline)

    def collect(self) -> tuple[list[tuple[Request, bool, bool]], list[Request]]:
        """The reads that ended, in the order they started: ``(done, given_up)``.

        ``done``: each request whose read is done, with whether it holds a seat and
        whether the read brought all it was to (what it brought counts as computed;
        the rest of the prompt is computed here). ``given_up``: each request whose read ran past
        its deadline, its blocks freed and nothing computed, to wait again. An aborted
        request is in neither: its blocks go back once nothing writes them."""
        if self.connector is not None:
            self.connector.pump()
        if self._abandoned:
            still = []
            for fut, held in self._abandoned:
                if fut.done():
                    self.kv.unpin(held)
                else:
                    still.append((fut, held))
            self._abandoned = still
        done: list[tuple[Request, bool, bool]] = []
        given_up: list[Request] = []
        now = time.monotonic()
        for key, (req, fut, pooled, seated, deadline) in list(self.loading.items()):
            if not fut.done():
                if now > deadline:
                    del self.loading[key]
                    if self._give_up(req, fut):
                        given_up.append(req)
                continue
            del self.loading[key]
            if req.is_finished:  # aborted while loading
                self.kv.free(req)
                continue
            try:
                loaded = fut.result()
            except Exception:  # noqa: BLE001 (a failed load is a recompute, not a crash)
                log.exception("request %s: pool load failed; recomputing", req.request_id)
                loaded = 0
            req.num_computed_tokens += loaded  # (its blocks findable once computed past)
            done.append((req, seated, loaded == pooled))
        return done, given_up

    def _give_up(self, req: Request, fut: Future) -> bool:
        """The read is still running past its timeout (a peer stopped answering): its
        blocks stay held until it ends, and the request starts over without the pool.
        False if it was aborted while loading (nothing to start over)."""
        self.timeouts += 1
        log.warning("request %s: pool read still running after %.1f s; computing the "
                    "prompt here", req.request_id, self.timeout_s)
        self._abandoned.append((fut, self.kv.pin(req)))
        self.kv.free(req)
        if req.is_finished:  # aborted while loading
            return False
        req.num_computed_tokens = 0
        req.pool_gave_up = True
        return True

    def wait(self, timeout: float) -> None:
        """Until one loading request's read is done, or ``timeout`` seconds."""
        futures.wait([f for _, f, *_ in self.loading.values()], timeout=timeout,
                     return_when=futures.FIRST_COMPLETED)
