"""Which instance serves a request, from the registry.

Prefill: the least estimated time to first token, in the spirit of Mooncake's conductor:
prompt tokens already queued on the instance plus the tokens of this prompt it would
have to compute. What an instance still holds in its local prefix cache is estimated
here, from the prompts this gateway sent it (chained block hashes, newest kept, at most
the instance's KV capacity), so a shared prefix goes back where it is cached while a
busy instance still loses to an idle one. Every prefill instance reads the same pool,
so pool hits lower the cost equally everywhere and do not change the choice. Decode:
fewest KV blocks in use, then fewest running requests. Ties are broken at random so
identical prompts cannot pile onto one instance. Draining instances get nothing. A
request running a LoRA adapter goes among the instances holding it in memory, when any
does (adapter affinity); another reads it from its folder, which the request carries.
Queue lengths come with heartbeats; between two, the tokens this gateway has in flight
on an instance stand in for the queue when they are more.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import OrderedDict
from typing import Protocol

import redis

from pdmesh.shared.infra.registry import Instance, Registry

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 128  # for instances that do not publish theirs
# an instance whose heartbeat (every second) has not changed for this long is not counted
# live (/health), though its entry lasts until the registry's TTL (6 s) expires it
LIVE_S = 3.0
# --decode-tpot-slo-ms: a decode step that also computes an offloaded prompt stays under
# this (DistServe's and Splitwise's chat SLOs put TPOT at 50-100 ms; the stricter end)
DEFAULT_DECODE_TPOT_SLO_MS = 50.0


def block_hashes(prompt: list[int], block_size: int) -> list[int]:
    """One hash per full block, each chained to the blocks before it (a block matches
    only with the same prefix), as the engines' prefix caches key their blocks."""
    out, parent = [], 0
    for start in range(0, len(prompt) - block_size + 1, block_size):
        parent = hash((parent, tuple(prompt[start:start + block_size])))
        out.append(parent)
    return out


class PrefixEstimate:
    """The blocks an instance probably still caches: those it was sent last, at most
    ``capacity`` of them (its KV blocks; older ones it has likely evicted)."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def hits(self, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` found (a prefix cache only matches from the start)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def add(self, hashes: list[int], capacity: int) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > max(capacity, 0):
            self._blocks.popitem(last=False)


_EMPTY = PrefixEstimate()


class RouteQuery:
    """One pick's question: the prompt (if any) and its block hashes, computed once per
    block size however many instances are weighed."""

    def __init__(self, router: Router, prompt: list[int] | None):
        self.router = router
        self.prompt = prompt
        self._hashes: dict[int, list[int]] = {}

    def hashes(self, block_size: int) -> list[int]:
        if block_size not in self._hashes:
            self._hashes[block_size] = block_hashes(self.prompt or [], block_size)
        return self._hashes[block_size]


class RouteCost(Protocol):
    """A routing policy: the cost of sending the query to ``inst`` (lower wins; ties
    are broken at random)."""

    def cost(self, inst: Instance, query: RouteQuery) -> tuple[int, ...]: ...


def _busy(inst: Instance) -> int:
    return inst.load.get("running", 0) + inst.load.get("waiting", 0)


class EstimatedTTFT:
    """Prefill: prompt tokens queued there, plus this prompt's tokens it would compute
    (those not in its estimated prefix cache); then requests busy there."""

    def cost(self, inst: Instance, query: RouteQuery) -> tuple[int, ...]:
        queued = query.router.queued_tokens(inst)
        prompt = query.prompt
        if prompt is None:
            return queued, _busy(inst)
        cached = query.router.estimated_cached_tokens(inst, query)
        return queued + len(prompt) - min(cached, len(prompt) - 1), _busy(inst)


class KVBlocksInUse:
    """Decode: fewest KV blocks in use, then fewest requests busy."""

    def cost(self, inst: Instance, query: RouteQuery) -> tuple[int, ...]:
        ld = inst.load
        return ld.get("total_kv_blocks", 0) - ld.get("free_kv_blocks", 0), _busy(inst)


class Router:
    """Picks from a cached copy of the registry. After ``start`` a background thread
    keeps the copy fresh, so a pick on the gateway's event loop never waits on redis;
    without it (tests, tools) a pick re-reads the registry when the copy is stale."""

    def __init__(self, registry: Registry, model: str | None = None, refresh_s: float = 0.25,
                 offload_threshold: int = 0, costs: dict[str, RouteCost] | None = None,
                 decode_tpot_slo_ms: float = DEFAULT_DECODE_TPOT_SLO_MS,
                 stall_timeout_s: float = 10.0):
        """``costs``: the cost policy per role (default: estimated TTFT for prefill and
        mixed instances, KV blocks in use for decode)."""
        self.registry = registry
        self.costs = costs or {"prefill": EstimatedTTFT(), "mixed": EstimatedTTFT(),
                               "decode": KVBlocksInUse()}
        self.model = model  # only instances serving this model (None: any)
        self.refresh_s = refresh_s
        # prefill offload (0: off) and the decode step time it may never exceed: see
        # ``offload_target``
        self.offload_threshold = offload_threshold
        self.decode_tpot_slo_ms = decode_tpot_slo_ms
        # an instance whose engine has had work this long without finishing a step
        # (stalled_ms in its heartbeat) is neither routed to nor waited for
        self.stall_ms = stall_timeout_s * 1000
        self._cache: list[Instance] = []
        self._at = float("-inf")
        self._unread = False  # the last refresh could not read redis
        self._grace_until = float("-inf")
        self._lock = threading.Lock()
        self._rng = random.Random()
        self._refresh_now = threading.Event()
        self._stopped = threading.Event()
        self._background = False
        self._estimates: dict[str, PrefixEstimate] = {}  # prefill instance id -> its cache
        # instance id -> prompt tokens sent and not yet answered (prefill instances, and
        # decode instances prefilling offloaded prompts)
        self._inflight: dict[str, int] = {}
        # instance id -> (its last heartbeat's stamp, when this router saw it change): an
        # instance whose beats stopped stays in the registry until its key expires
        self._beats: dict[str, tuple[float, float]] = {}
        self._adapters: dict[str, str] = {}  # the LoRA adapters served: name -> folder

    def start(self) -> None:
        self._refresh()
        self._background = True
        threading.Thread(target=self._refresh_loop, name="router-refresh", daemon=True).start()

    def _refresh(self) -> None:
        found = self.registry.instances(model=self.model)
        adapters = self.registry.adapters()
        now = time.monotonic()
        with self._lock:
            self._adapters = adapters
            if self._unread:  # redis is back, maybe empty (restarted) until every
                self._unread = False  # instance has heartbeated again: for one TTL the
                self._grace_until = now + self.registry.ttl_ms / 1000  # last copy helps
            if now < self._grace_until:
                ids = {i.id for i in found}
                found += [i for i in self._cache if i.id not in ids]
            self._cache = found
            self._at = now
            beats = {}
            for i in found:  # (stamps compared as written: no clock shared with the host)
                stamp, seen = self._beats.get(i.id, (None, now))
                beats[i.id] = (i.heartbeat, now if stamp != i.heartbeat else seen)
            self._beats = beats

    def stop(self) -> None:
        """End the background refresh (``start``'s thread), at its next wake-up."""
        self._stopped.set()
        self._refresh_now.set()

    def _refresh_loop(self) -> None:
        while not self._stopped.is_set():
            self._refresh_now.wait(self.refresh_s)
            self._refresh_now.clear()
            if self._stopped.is_set():
                return
            try:
                self._refresh()
            except redis.RedisError as e:  # keep routing on the last copy
                log.warning("registry refresh failed: %s", e)
                self._unread = True

    # -- LoRA adapters --------------------------------------------------------------------
    def adapters(self) -> dict[str, str]:
        """The LoRA adapters the mesh serves (name -> folder), as last read."""
        if not self._background and time.monotonic() - self._at > self.refresh_s:
            self._refresh()
        with self._lock:
            return dict(self._adapters)

    def serve_adapter(self, name: str, path: str) -> bool:
        """Add an adapter to the mesh's (False: one of that name is served already)."""
        added = self.registry.put_adapter(name, path)
        if added:
            with self._lock:
                self._adapters[name] = path
        return added

    def unserve_adapter(self, name: str) -> bool:
        """Take an adapter out of the mesh's (False: none of that name is served)."""
        removed = self.registry.remove_adapter(name)
        with self._lock:
            self._adapters.pop(name, None)
        return removed

    def instances(self, role: str, runner: str = "generate") -> list[Instance]:
        """The instances of ``role`` that serve: not draining, not stalled, running
        ``runner`` (generate; pooling: those that serve embeddings)."""
        if not self._background and time.monotonic() - self._at > self.refresh_s:
            self._refresh()
        with self._lock:
            return [i for i in self._cache if i.role == role and not i.draining
                    and i.runner == runner and i.load.get("stalled_ms", 0) < self.stall_ms]

    def live(self, role: str, within_s: float = LIVE_S, runner: str = "generate"
             ) -> list[Instance]:
        """``instances(role)`` whose heartbeats still come: a new one seen within
        ``within_s`` (a killed instance's entry, until its key expires, is not)."""
        now = time.monotonic()
        found = self.instances(role, runner)
        with self._lock:
            return [i for i in found if now - self._beats.get(i.id, (0.0, now))[1] < within_s]

    def listed(self, instance_id: str) -> bool:
        """Whether the instance is alive: still in the registry (heartbeating; draining
        counts) and its engine stepping (not stalled). While redis cannot be read, the
        last copy answers."""
        if not self._background and time.monotonic() - self._at > self.refresh_s:
            self._refresh()
        with self._lock:
            return any(i.id == instance_id and i.load.get("stalled_ms", 0) < self.stall_ms
                       for i in self._cache)

    def pick(self, role: str, exclude: set[str] | frozenset[str] = frozenset(),
             prompt: list[int] | None = None, runner: str = "generate",
             adapter: str | None = None) -> Instance | None:
        """The cheapest live instance of ``role`` (running ``runner``) by its cost
        policy; for prefill, ``prompt`` lets cached prefixes count. A request running
        LoRA ``adapter`` goes to an instance holding it if any does (one that does not
        reads it first)."""
        live = [i for i in self.instances(role, runner) if i.id not in exclude]
        if not live:
            return None
        if adapter is not None:
            live = [i for i in live if adapter in i.adapters] or live
        query = RouteQuery(self, prompt)
        policy = self.costs.get(role, self.costs["prefill"])
        costs = {i.id: policy.cost(i, query) for i in live}
        best = min(costs.values())
        return self._rng.choice([i for i in live if costs[i.id] == best])

    def queued_tokens(self, inst: Instance) -> int:
        """Prompt tokens waiting on ``inst``: what it published, or what this gateway
        has in flight there if that is more (heartbeats lag)."""
        return max(inst.load.get("queued_prefill_tokens", 0), self._inflight.get(inst.id, 0))

    def estimated_cached_tokens(self, inst: Instance, query: RouteQuery) -> int:
        """Leading prompt tokens ``inst`` probably still holds in its prefix cache."""
        bs = inst.load.get("block_size") or DEFAULT_BLOCK_SIZE
        return self._estimates.get(inst.id, _EMPTY).hits(query.hashes(bs)) * bs

    def sent(self, inst: Instance, prompt: list[int]) -> None:
        """A prompt went to instance ``inst`` to be prefilled: it will cache the prompt's
        blocks and has its tokens queued until ``answered``."""
        with self._lock:
            bs = inst.load.get("block_size") or DEFAULT_BLOCK_SIZE
            est = self._estimates.setdefault(inst.id, PrefixEstimate())
            est.add(block_hashes(prompt, bs), inst.load.get("total_kv_blocks") or 1 << 30)
            self._inflight[inst.id] = self._inflight.get(inst.id, 0) + len(prompt)

    def answered(self, inst: Instance, prompt: list[int]) -> None:
        with self._lock:
            left = self._inflight.get(inst.id, 0) - len(prompt)
            if left > 0:
                self._inflight[inst.id] = left
            else:
                self._inflight.pop(inst.id, None)

    def offload_target(self, prompt: list[int]) -> Instance | None:
        """A decode instance that should prefill this prompt itself, or None (the usual
        path through a prefill instance).

        Only while prefill is backed up: when even the least-loaded prefill instance has
        at least ``offload_threshold`` prompt tokens queued, a decode instance takes the
        prompt if its own queue of prompts to prefill stays under half of that backlog
        and - decode protected by construction - if a step that computes the prompt (or
        its first chunk) next to its decode rows stays within ``decode_tpot_slo_ms``, by
        the step costs it publishes (one that has not measured them yet takes nothing).
        A prompt that a prefill instance probably holds the most of in its prefix cache
        (over half of it: a shared system prompt, an earlier turn) stays there: a
        decode instance would compute it whole.
        A burst is then prefilled by both kinds of instance at once and reaches decode
        sooner; at low load nothing changes (decode never computes a prompt, its steps
        stay short). Worth it where prefill and decode share hardware (``pdmesh up`` on
        one box); on separate machines it trades decode step time for TTFT, which the
        budget bounds.

        With no prefill instance alive at all, the least busy decode instance prefills
        every prompt (``fallback_decode``): served slower beats refused."""
        prefill = self.instances("prefill")
        if not prefill:
            return self.fallback_decode()
        if not self.offload_threshold:
            return None
        # a decode instance that never computed a prompt is priced at the prefill
        # instances' cost per prompt token (same model; the dearest of them)
        per_token_ns = max(i.load.get("prefill_ns_per_token", 0) for i in prefill)
        decode = [i for i in self.instances("decode")
                  if self.offloaded_step_ms(i, len(prompt), per_token_ns)
                  <= self.decode_tpot_slo_ms]
        if not decode:
            return None
        with self._lock:
            backlog = min(self.queued_tokens(i) for i in prefill)
            if backlog < self.offload_threshold:
                return None
            best = min(decode, key=lambda i: self._inflight.get(i.id, 0))
            if self._inflight.get(best.id, 0) + len(prompt) > backlog // 2:
                return None
        # (hashed only now: at low load the backlog test above ends it)
        query = RouteQuery(self, prompt)
        if 2 * max(self.estimated_cached_tokens(i, query) for i in prefill) > len(prompt):
            return None
        return best

    def fallback_decode(self) -> Instance | None:
        """The decode instance with the fewest prompt tokens sent to it to prefill
        (None: there is none)."""
        decode = self.instances("decode")
        if not decode:
            return None
        with self._lock:
            return min(decode, key=lambda i: self._inflight.get(i.id, 0))

    @staticmethod
    def offloaded_step_ms(inst: Instance, prompt_tokens: int, fallback_ns_per_token: int = 0
                          ) -> float:
        """A decode instance's step time while it computes ``prompt_tokens`` (at most a
        step's worth of them) beside its decode rows, by the costs it publishes (its
        cost per prompt token, else ``fallback_ns_per_token``); inf with neither."""
        per_token_ns = inst.load.get("prefill_ns_per_token", 0) or fallback_ns_per_token
        if not per_token_ns:
            return math.inf
        chunk = inst.load.get("max_num_batched_tokens") or prompt_tokens
        step_us = inst.load.get("decode_step_us", 0)  # 0: no decode step measured yet
        return (step_us + min(prompt_tokens, chunk) * per_token_ns / 1e3) / 1e3

    def forget(self) -> None:
        """Re-read the registry soon (after an instance failed)."""
        with self._lock:
            self._at = float("-inf")
        self._refresh_now.set()
