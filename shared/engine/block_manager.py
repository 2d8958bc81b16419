"""Paged KV-cache blocks: the pool, prefix caching by chained block hash, per-request tables.

    request tokens  | t0 .. t127 | t128 .. t255 | t256 .. t300 |
    block hashes    |  h0        |  h1          |  (not full: no hash)
    h0 = H(root, tokens of block 0), h1 = H(h0, tokens of block 1), ...
    root = H(model fingerprint)   -> the same prefix gives the same keys in any process

A freed block keeps its hash and stays findable until it is reused: the free list is
in LRU order, so the least recently freed block is evicted first, and a request frees
its blocks tail first (a prefix outlives its continuations).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from pdmesh.shared.engine.request import Request


class BlockHasher:
    """Chained, content-addressed block hashes (blake2b, 16 bytes)."""

    def __init__(self, block_size: int, fingerprint: str = ""):
        self.block_size = block_size
        self.root = hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()

    def hash_block(self, parent: bytes, tokens: list[int]) -> bytes:
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(np.asarray(tokens, dtype=np.int64).tobytes())
        return h.digest()

    def update(self, request: Request) -> list[bytes]:
        """Extend ``request.block_hashes`` to cover every full block of its tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.token_ids
        parent = hashes[-1] if hashes else self.root
        for i in range(len(hashes), len(tokens) // bs):
            parent = self.hash_block(parent, tokens[i * bs:(i + 1) * bs])
            hashes.append(parent)
        return hashes


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered


NULL_BLOCK_ID = 0


class BlockPool:
    """All KV blocks. Free blocks wait in LRU order; full blocks are findable by hash.

    Block 0 is the null block: never handed out and kept zero, so padded reads of the
    cache can point at it. ``num_blocks`` usable blocks have ids 1..num_blocks.
    Invariant: a usable block is in the free list iff its ref_cnt is 0.
    """

    def __init__(self, num_blocks: int, enable_caching: bool):
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks + 1)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[NULL_BLOCK_ID + 1:])
        self._cached: dict[bytes, KVBlock] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on already-filled blocks (prefix-cache hits)."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise RuntimeError(f"allocate {n} blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            _, b = self._free.popitem(last=False)
            if b.block_hash is not None:  # evict its cached content
                if self._cached.get(b.block_hash) is b:
                    del self._cached[b.block_hash]
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each, tail first, so a prefix outlives what follows it."""
        for b in reversed(blocks):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[b.block_id] = b

    def register(self, block: KVBlock, block_hash: bytes) -> None:
        """Make a full block findable by its hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self._cached.setdefault(block_hash, block)

    def unregister(self, block: KVBlock) -> None:
        """Make a block unfindable again (its content turned out not to be what its
        hash says)."""
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for b in self._cached.values():
            b.block_hash = None
        self._cached.clear()


@dataclass
class _Held:
    """The blocks one request holds, in token order."""

    blocks: list[KVBlock] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # block ids, kept beside the blocks
    registered: int = 0  # how many leading blocks are findable by hash


class KVCacheManager:
    """Which blocks each request holds; allocation with prefix-cache reuse."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 fingerprint: str = ""):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.hasher = BlockHasher(block_size, fingerprint)
        self._held: dict[str, _Held] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request: Request) -> list[int]:
        """The request's block table (read-only: the manager's own list)."""
        held = self._held.get(request.request_id)
        return held.ids if held is not None else []

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Longest run of the request's leading full blocks already in the cache.

        At least the last token is always left to compute, so the step has a query.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = self.hasher.update(request)
        limit = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in hashes[:limit]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def allocate(self, request: Request, num_new_tokens: int,
                 cached: list[KVBlock] | None = None) -> bool:
        """Room for ``num_new_tokens`` beyond what the request has computed (plus the
        ``cached`` prefix hits it is about to adopt). False, changing nothing, if the
        pool cannot supply it."""
        held = self._held.get(request.request_id)
        num_held = len(held.blocks) if held is not None else 0
        num_cached = len(cached) if cached else 0
        num_tokens = request.num_computed_tokens + num_cached * self.block_size + num_new_tokens
        needed = self.blocks_for(num_tokens) - num_held - num_cached
        if cached:
            # cached hits sitting in the free list stop being allocatable once touched
            reclaimed = sum(1 for b in cached if b.ref_cnt == 0)
            if needed > self.pool.num_free - reclaimed:
                return False
        elif needed > self.pool.num_free:
            return False
        if held is None:
            held = self._held[request.request_id] = _Held()
        if cached:
            self.pool.touch(cached)
            held.blocks.extend(cached)
            held.ids.extend(b.block_id for b in cached)
        if needed > 0:
            new = self.pool.allocate(needed)
            held.blocks.extend(new)
            held.ids.extend(b.block_id for b in new)
        if self.enable_prefix_caching:
            full = min(num_tokens, request.num_tokens) // self.block_size
            if full > held.registered:  # blocks that this step fills become findable
                hashes = self.hasher.update(request)
                for i in range(held.registered, full):
                    self.pool.register(held.blocks[i], hashes[i])
                held.registered = full
        return True

    def forget_from(self, request: Request, first_block: int) -> None:
        """Withdraw the prefix-cache registration of the request's blocks from
        ``first_block`` on: they were registered for content that never arrived."""
        held = self._held.get(request.request_id)
        if held is None:
            return
        for b in held.blocks[first_block:held.registered]:
            self.pool.unregister(b)
        held.registered = min(held.registered, first_block)

    def free(self, request: Request) -> None:
        held = self._held.pop(request.request_id, None)
        if held is not None:
            self.pool.free(held.blocks)
