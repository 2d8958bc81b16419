"""Which instance serves a request, from the registry.

Prefill: the least estimated time to first token, i.e. the fewest prompt tokens queued
ahead (published with each heartbeat), then the fewest requests — in the spirit of
Mooncake's conductor. Every prefill instance reads the same pool, so pool hits lower the
new prompt's cost equally everywhere and do not change the choice. Decode: fewest KV
blocks in use, then fewest running requests. Ties are broken at random so
identical prompts cannot pile onto one instance. Draining instances get nothing.
"""

from __future__ import annotations

import random
import threading
import time

from shared.registry import Instance, Registry


class Router:
    def __init__(self, registry: Registry, model: str | None = None, refresh_s: float = 0.25):
        self.registry = registry
        self.model = model
        self.refresh_s = refresh_s
        self._cache: list[Instance] = []
        self._at = 0.0
        self._lock = threading.Lock()
        self._rng = random.Random()

    def instances(self, role: str) -> list[Instance]:
        with self._lock:
            if time.monotonic() - self._at > self.refresh_s:
                self._cache = self.registry.instances()
                self._at = time.monotonic()
            return [i for i in self._cache if i.role == role and not i.draining]

    def pick(self, role: str, exclude: set[str] | frozenset[str] = frozenset()
             ) -> Instance | None:
        live = [i for i in self.instances(role) if i.id not in exclude]
        if not live:
            return None

        def cost(i: Instance) -> tuple[int, int]:
            ld = i.load
            if role == "decode":
                used = ld.get("total_kv_blocks", 0) - ld.get("free_kv_blocks", 0)
                return used, ld.get("running", 0) + ld.get("waiting", 0)
            return (ld.get("queued_prefill_tokens", 0),
                    ld.get("waiting", 0) + ld.get("running", 0))

        best = min(cost(i) for i in live)
        return self._rng.choice([i for i in live if cost(i) == best])

    def forget(self) -> None:
        """Re-read the registry on the next pick (after an instance failed)."""
        with self._lock:
            self._at = 0.0
