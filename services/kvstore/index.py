"""The kvstore's logic, with no gRPC in it: pool lookups, stats and clearing.

The service is itself a small member of the Mooncake cluster (a client with a tiny
segment) and answers "which of these keys exist" for routers that choose a prefill
instance by how much of a prompt the pool already holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from pdmesh.shared.kvpool.base import KVPool


@dataclass
class IndexStats:
    keys: int
    bytes: int
    hits: int
    misses: int


class PoolIndex:
    def __init__(self, pool: KVPool,
                 master_metrics: Callable[[], dict[str, float]] | None = None):
        self.pool = pool
        self._master_metrics = master_metrics  # () -> dict of the master's gauges
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def lookup(self, keys: list[str]) -> tuple[list[bool], int]:
        """(exists per key, leading hits)."""
        found = self.pool.exists(keys)
        prefix = next((i for i, f in enumerate(found) if not f), len(found))
        with self._lock:
            self.hits += sum(found)
            self.misses += len(found) - sum(found)
        return found, prefix

    def stats(self) -> IndexStats:
        gauges: dict[str, float] = {}
        if self._master_metrics is not None:
            try:
                gauges = self._master_metrics()
            except OSError:  # the master is restarting: its gauges are unknown for now
                gauges = {}
        with self._lock:
            return IndexStats(keys=int(gauges.get("master_key_count", -1)),
                              bytes=int(gauges.get("master_allocated_bytes", -1)),
                              hits=self.hits, misses=self.misses)

    def clear(self) -> int:
        return self.pool.clear()
