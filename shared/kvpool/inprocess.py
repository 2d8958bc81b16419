"""An in-process KV pool: a dict of bytes, for unit tests and single-process use."""

from __future__ import annotations

import ctypes
import threading

from pdmesh.shared.kvpool.base import KVPool, PoolStats, Region


class InProcessPool(KVPool):
    def __init__(self, capacity_bytes: int | None = None):
        self._values: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._capacity = capacity_bytes
        self._bytes = 0
        self._hits = 0
        self._misses = 0

    def exists(self, keys: list[str]) -> list[bool]:
        with self._lock:
            found = [k in self._values for k in keys]
            self._hits += sum(found)
            self._misses += len(found) - sum(found)
            return found

    def put(self, keys: list[str], regions: list[list[Region]]) -> list[bool]:
        out = []
        with self._lock:
            for key, regs in zip(keys, regions, strict=True):
                if key not in self._values:
                    size = sum(n for _, n in regs)
                    if self._capacity is not None and self._bytes + size > self._capacity:
                        out.append(False)
                        continue
                    self._values[key] = b"".join(ctypes.string_at(addr, n) for addr, n in regs)
                    self._bytes += size
                out.append(True)
        return out

    def get(self, keys: list[str], regions: list[list[Region]]) -> list[bool]:
        out = []
        with self._lock:
            for key, regs in zip(keys, regions, strict=True):
                value = self._values.get(key)
                if value is None or len(value) != sum(n for _, n in regs):
                    self._misses += 1
                    out.append(False)
                    continue
                self._hits += 1
                offset = 0
                for addr, n in regs:
                    ctypes.memmove(addr, value[offset:offset + n], n)
                    offset += n
                out.append(True)
        return out

    def clear(self) -> int:
        with self._lock:
            n = len(self._values)
            self._values.clear()
            self._bytes = 0
            return n

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(len(self._values), self._bytes, self._hits, self._misses)
