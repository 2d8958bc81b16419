"""A pool that follows its Mooncake master wherever the kvstore brings it back.

An engine joins the master its kvstore names. A master restarted on the same address
is rejoined by Mooncake's client by itself (it remounts its segment); one that comes
back elsewhere - a kvstore restarted on other ports, or on another host - is not. This
pool watches: while the master it uses does not answer, it asks where the master is now
(``resolve``: the kvstore's Stats, at its flag's address or at any kvstore in the
registry), joins the new one, registers the same cache memory there, and moves every
later call over. Calls made while the master is away fail fast with ``PoolUnavailable``
(a ConnectionError), which the engine answers by computing the prompt itself.

    watcher (every interval)   current master answers? -> nothing to do
                               else resolve() -> (master, metadata) elsewhere?
                                    -> connect, register the tensors, swap;
                                       the old client goes once no call uses it
                                       (MooncakePool.close keeps one whose master is
                                       gone: closing it would stop the process)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdmesh.shared.kvpool.base import KVPool, PoolStats, Region

if TYPE_CHECKING:  # (the kvstore serves the pool without torch)
    import torch

log = logging.getLogger(__name__)

MasterAddress = tuple[str, str]  # (master host:port, metadata url)


class FollowingPool(KVPool):
    """``connect(master)`` builds a client of one master (a ``MooncakePool``) and must
    offer ``master_alive()`` and ``master_address``/``metadata_url``; ``resolve()``
    answers where the master is now, or None when nobody knows."""

    def __init__(self, first: KVPool, connect: Callable[[MasterAddress], KVPool],
                 resolve: Callable[[], MasterAddress | None], interval_s: float = 1.0):
        self._current = first
        self._connect = connect
        self._resolve = resolve
        self._tensors: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._busy: dict[int, int] = {id(first): 0}  # calls in flight per client
        self._retired: list[KVPool] = []
        self._moved = 0
        self._carried = PoolStats(keys=-1, bytes=-1, hits=0, misses=0)  # of old clients
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, args=(interval_s,),
                                         name="kv-pool-follow", daemon=True)
        self._watcher.start()

    @property
    def master_address(self) -> str:
        return self._current.master_address  # type: ignore[attr-defined]

    @property
    def moves(self) -> int:
        """How many times it followed the master to a new address."""
        return self._moved

    # -- calls, each on the client current when it starts --------------------------------
    def _call(self, name: str, *args):
        with self._lock:
            pool = self._current
            self._busy[id(pool)] += 1
        try:
            return getattr(pool, name)(*args)
        finally:
            with self._lock:
                self._busy[id(pool)] -= 1

    def exists(self, keys: list[str]) -> list[bool]:
        return self._call("exists", keys)

    def put(self, keys: list[str], regions: list[list[Region]]) -> list[bool]:
        return self._call("put", keys, regions)

    def get(self, keys: list[str], regions: list[list[Region]]) -> list[bool]:
        return self._call("get", keys, regions)

    def clear(self) -> int:
        return self._call("clear")

    def stats(self) -> PoolStats:
        """The current client's, with the hits and misses of those before it (counters
        never go back when it moves)."""
        now = self._call("stats")
        return PoolStats(keys=now.keys, bytes=now.bytes, hits=now.hits + self._carried.hits,
                         misses=now.misses + self._carried.misses)

    def register(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self._tensors.append(tensor)
        self._call("register", tensor)

    def close(self) -> None:
        self._stop.set()
        self._watcher.join(timeout=5)
        with self._lock:
            pools = [self._current, *self._retired]
            self._retired = []
        for pool in pools:
            pool.close()

    # -- following ------------------------------------------------------------------------
    def _watch(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.follow()
            except Exception:  # noqa: BLE001 (the watcher must outlive one bad round)
                log.exception("kv pool: following the master failed; trying again")
            self._close_retired()

    def follow(self) -> bool:
        """One round: if the master is gone and is found elsewhere, move there. Returns
        whether it moved."""
        current = self._current
        if current.master_alive():  # type: ignore[attr-defined]
            return False
        found = self._resolve()
        here = (current.master_address, current.metadata_url)  # type: ignore[attr-defined]
        if found is None or found == here:
            return False  # not back yet, or back where it was (Mooncake rejoins by itself)
        fresh = self._connect(found)
        with self._lock:
            tensors = list(self._tensors)
        for t in tensors:
            fresh.register(t)
        with self._lock:
            old = current.stats()
            self._carried = PoolStats(-1, -1, self._carried.hits + old.hits,
                                      self._carried.misses + old.misses)
            self._current = fresh
            self._busy[id(fresh)] = 0
            self._retired.append(current)
        self._moved += 1
        log.warning("kv pool: the Mooncake master moved from %s to %s; following it",
                    here[0], found[0])
        return True

    def _close_retired(self) -> None:
        with self._lock:
            idle = [p for p in self._retired if self._busy.get(id(p), 0) == 0]
            self._retired = [p for p in self._retired if p not in idle]
            for p in idle:
                self._busy.pop(id(p), None)
        for p in idle:
            try:
                p.close()
            except Exception:  # noqa: BLE001 (its master is gone; closing is best effort)
                log.debug("kv pool: closing the old client failed", exc_info=True)
