"""Which instance serves a request, from the registry.

Prefill: the least estimated time to first token, i.e. the fewest prompt tokens queued
ahead (published with each heartbeat), then the fewest requests — in the spirit of
Mooncake's conductor. Every prefill instance reads the same pool, so pool hits lower the
new prompt's cost equally everywhere and do not change the choice. Decode: fewest KV
blocks in use, then fewest running requests. Ties are broken at random so
identical prompts cannot pile onto one instance. Draining instances get nothing.
"""

from __future__ import annotations

import logging
import random
import threading
import time

import redis

from shared.registry import Instance, Registry

log = logging.getLogger(__name__)


class Router:
    """Picks from a cached copy of the registry. After ``start`` a background thread
    keeps the copy fresh, so a pick on the gateway's event loop never waits on redis;
    without it (tests, tools) a pick re-reads the registry when the copy is stale."""

    def __init__(self, registry: Registry, model: str | None = None, refresh_s: float = 0.25):
        self.registry = registry
        self.model = model  # only instances serving this model (None: any)
        self.refresh_s = refresh_s
        self._cache: list[Instance] = []
        self._at = float("-inf")
        self._lock = threading.Lock()
        self._rng = random.Random()
        self._refresh_now = threading.Event()
        self._background = False

    def start(self) -> None:
        self._refresh()
        self._background = True
        threading.Thread(target=self._refresh_loop, name="router-refresh", daemon=True).start()

    def _refresh(self) -> None:
        found = self.registry.instances(model=self.model)
        with self._lock:
            self._cache = found
            self._at = time.monotonic()

    def _refresh_loop(self) -> None:
        while True:
            self._refresh_now.wait(self.refresh_s)
            self._refresh_now.clear()
            try:
                self._refresh()
            except redis.RedisError as e:  # keep routing on the last copy
                log.warning("registry refresh failed: %s", e)

    def instances(self, role: str) -> list[Instance]:
        if not self._background and time.monotonic() - self._at > self.refresh_s:
            self._refresh()
        with self._lock:
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
        """Re-read the registry soon (after an instance failed)."""
        with self._lock:
            self._at = float("-inf")
        self._refresh_now.set()
