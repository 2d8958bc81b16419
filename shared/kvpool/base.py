"""The KV pool interface: content-addressed KV blocks shared between processes.

A pool value is one KV block of every layer, concatenated:

    key  = "<model fingerprint + KV layout>/<chained block hash, hex>"
    value = K[layer 0][block] | V[layer 0][block] | K[layer 1][block] | ... | V[layer L-1][block]
            (MLA: the latent of each layer; DeepSeek-V4: one cache group's tensors)

Values move between the pool and a paged KV cache with no Python-side copies: a block
is described by its memory regions (one (address, nbytes) per layer and K/V, straight
into the cache tensors), and backends copy region by region. Because keys are the
content's chained hash, the same prefix gives the same keys in any instance: the pool is
also a cross-instance prefix cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the kvstore serves the pool without torch)
    import torch


Region = tuple[int, int]  # (address, nbytes)


TIMES_KEPT = 4096  # transfer times kept between two metrics scrapes


def keep_time(times: list[float], seconds: float) -> None:
    """Add a transfer's seconds to a list the metrics collector reads and clears (bounded
    should nobody read it)."""
    times.append(seconds)
    if len(times) > TIMES_KEPT:
        del times[:TIMES_KEPT // 2]


@dataclass
class PoolStats:
    keys: int
    bytes: int
    hits: int  # keys found by lookups and gets
    misses: int


class KVPool(ABC):
    """Put, get and find KV blocks by key. Implementations are thread-safe."""

    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]:
        """Which keys the pool holds (counted as hits / misses)."""

    def prefix_hits(self, keys: list[str]) -> int:
        """How many leading keys the pool holds."""
        n = 0
        for found in self.exists(keys):
            if not found:
                break
            n += 1
        return n

    @abstractmethod
    def put(self, keys: list[str], regions: list[list[Region]]) -> list[bool]:
        """Store each key's value, gathered from its regions. Existing keys are kept
        (same key, same content). Returns per key whether it is in the pool now."""

    @abstractmethod
    def get(self, keys: list[str], regions: list[list[Region]]) -> list[bool]:
        """Scatter each key's value into its regions. Returns per key whether it was
        found (regions of a missing key are left untouched)."""

    @abstractmethod
    def clear(self) -> int:
        """Drop every key; returns how many were dropped."""

    @abstractmethod
    def stats(self) -> PoolStats: ...

    def register(self, tensor: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """Announce memory that regions will point into (RDMA/TCP backends pin it)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections and registrations."""


class CacheRegions:
    """Maps a block id of a paged KV cache to its pool regions.

    tensors: the cache tensors of one block table - per layer (k_cache, v_cache), or
    MLA's latent, or a DeepSeek-V4 group's tensors; tuples per layer are flattened. Each
    is [num_blocks, slots, N, D] and contiguous, so block b of a tensor is one run of
    that tensor's block bytes; the value of a block is every tensor's run, in order.
    """

    def __init__(self, tensors: list[torch.Tensor] | list[tuple[torch.Tensor, ...]]):
        self.tensors = [t for item in tensors
                        for t in (item if isinstance(item, tuple) else (item,))]
        if not all(t.is_contiguous() for t in self.tensors):
            raise ValueError("kv_caches: every cache tensor must be contiguous")
        self.block_bytes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.bases = [t.data_ptr() for t in self.tensors]

    @property
    def value_bytes(self) -> int:
        return sum(self.block_bytes)

    def regions(self, block_id: int) -> list[Region]:
        return [(base + block_id * n, n) for base, n in zip(self.bases, self.block_bytes,
                                                             strict=True)]
