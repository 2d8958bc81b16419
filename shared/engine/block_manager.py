"""Paged KV-cache blocks: the pool, prefix caching by chained block hash, per-request tables.

    request tokens  | t0 .. t127 | t128 .. t255 | t256 .. t300 |
    block hashes    |  h0        |  h1          |  (not full: no hash)
    h0 = H(root, tokens of block 0), h1 = H(h0, tokens of block 1), ...
    root = H(model fingerprint)   -> the same prefix gives the same keys in any process
                                     (a LoRA adapter's request: H(root, the adapter's digest))

A freed block keeps its hash and stays findable until it is reused: the free list is
in LRU order, so the least recently freed block is evicted first, and a request frees
its blocks tail first (a prefix outlives its continuations).

A model may keep several cache groups (:mod:`pdmesh.shared.engine.kv_cache_spec`), each
with its own pool and block table under the same token blocks and hashes: DeepSeek-V4's
compressed history in one, its sliding window in another, whose blocks are given back
once the window has passed them (and stay findable, like any freed block).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pdmesh.shared.engine.request import Request


class BlockHasher:
    """Chained, content-addressed block hashes (blake2b, 16 bytes)."""

    def __init__(self, block_size: int, fingerprint: str = ""):
        self.block_size = block_size
        self.root = hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()

    def root_for(self, identity: str) -> bytes:
        """The chain root of requests whose KV depends on more than the tokens (a LoRA
        adapter's ``identity``): the model's root hashed with it."""
        return hashlib.blake2b(self.root + identity.encode(), digest_size=16).digest()

    def root_of(self, request: Request) -> bytes:
        return request.hash_root if request.hash_root is not None else self.root

    def hash_block(self, parent: bytes, tokens: list[int]) -> bytes:
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(np.asarray(tokens, dtype=np.int64).tobytes())
        return h.digest()

    def update(self, request: Request) -> list[bytes]:
        """Extend ``request.block_hashes`` to cover every full block of its tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.token_ids
        parent = hashes[-1] if hashes else self.root_of(request)
        for i in range(len(hashes), len(tokens) // bs):
            parent = self.hash_block(parent, tokens[i * bs:(i + 1) * bs])
            hashes.append(parent)
        return hashes


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered
    hits: int = 0  # prefix-cache hits on its content (the KV tiers' selective writes)


NULL_BLOCK_ID = 0


class BlockPool:
    """All KV blocks. Free blocks wait in LRU order; full blocks are findable by hash.

    Block 0 is the null block: never handed out and kept zero, so padded reads of the
    cache can point at it. ``num_blocks`` usable blocks have ids 1..num_blocks.
    Invariant: a usable block is in the free list iff its ref_cnt is 0.
    """

    def __init__(self, num_blocks: int, enable_caching: bool,
                 on_evict: Callable[[list[KVBlock]], None] | None = None):
        """``on_evict``: called with the cached blocks an allocation is about to reuse,
        their content still in them (the KV tiers' write-back)."""
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks + 1)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[NULL_BLOCK_ID + 1:])
        self._cached: dict[bytes, KVBlock] = {}
        self.on_evict = on_evict

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
            b.ref_cnt = 1
            out.append(b)
        evicted = [b for b in out if b.block_hash is not None]
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        for b in evicted:  # their cached content goes
            if self._cached.get(b.block_hash) is b:
                del self._cached[b.block_hash]
            b.block_hash = None
            b.hits = 0
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
            block.hits = 0

    def reset_prefix_cache(self) -> None:
        for b in self._cached.values():
            b.block_hash = None
            b.hits = 0
        self._cached.clear()


@dataclass
class _Held:
    """The blocks one request holds in one group, in token order; a sliding group's
    blocks that fell out of its window are None (their table entries read block 0)."""

    blocks: list[KVBlock | None] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # block ids, kept beside the blocks
    registered: int = 0  # how many leading blocks were made findable by hash


@dataclass(frozen=True)
class GroupBlocks:
    """One cache group as the block manager sees it."""

    name: str
    num_blocks: int
    window: int | None = None  # sliding: tokens behind the next one to compute it keeps


@dataclass
class PrefixHit:
    """A cached prefix of ``num_blocks`` full blocks: per group, its blocks (a sliding
    group's only from the first one its window needs; None before that)."""

    num_blocks: int = 0
    blocks: list[list[KVBlock | None]] = field(default_factory=list)


class KVCacheManager:
    """Which blocks each request holds, in every cache group; allocation with
    prefix-cache reuse. Group 0 is the request's history (every block kept); a sliding
    group (DeepSeek-V4's window) gives back what its window left behind. Allocation is
    all or nothing across groups, and a prefix is a hit only where every group has it.
    """

    def __init__(self, num_blocks: int | list[GroupBlocks], block_size: int,
                 enable_prefix_caching: bool, fingerprint: str = ""):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = (list(num_blocks) if isinstance(num_blocks, list)
                       else [GroupBlocks("kv", num_blocks)])
        if self.groups[0].window is not None:
            raise ValueError("cache groups: the first group must keep every block")
        self.pools = [BlockPool(spec.num_blocks, enable_prefix_caching, self._evicting(g))
                      for g, spec in enumerate(self.groups)]
        self.pool = self.pools[0]
        self.hasher = BlockHasher(block_size, fingerprint)
        self._held: dict[str, list[_Held]] = {}
        # the KV tiers' (tier_connector.TierWrites): a group's cached blocks about to be
        # reused, and a group's blocks a prefix hit takes (their ``hits`` counted)
        self.on_evict: Callable[[int, list[KVBlock]], None] | None = None
        self.on_hit: Callable[[int, list[KVBlock]], None] | None = None
        # a request about to give its blocks back (prompt_saves.PromptSaves: a decode
        # instance that puts what it finished into the pool pins them here)
        self.on_free: Callable[[Request], None] | None = None

    def _evicting(self, group: int) -> Callable[[list[KVBlock]], None]:
        def evicting(blocks: list[KVBlock]) -> None:
            if self.on_evict is not None:
                self.on_evict(group, blocks)
        return evicting

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request: Request, group: int = 0) -> list[int]:
        """The request's block table in a group (read-only: the manager's own list)."""
        held = self._held.get(request.request_id)
        return held[group].ids if held is not None else []

    def _first_needed(self, group: int, next_token: int) -> int:
        window = self.groups[group].window
        if window is None:
            return 0
        return max(0, next_token - window) // self.block_size

    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """Longest run of the request's leading full blocks already in the cache: all of
        them in the history groups, the ones its window needs in the sliding groups.

        At least the last token is always left to compute, so the step has a query.
        """
        if not self.enable_prefix_caching:
            return PrefixHit()
        hashes = self.hasher.update(request)
        limit = (request.num_tokens - 1) // self.block_size
        longest = 0
        for h in hashes[:limit]:
            if any(self.pools[g].lookup(h) is None for g, spec in enumerate(self.groups)
                   if spec.window is None):
                break
            longest += 1
        sliding = [g for g, spec in enumerate(self.groups) if spec.window is not None]
        for n in range(longest, 0, -1):  # the longest prefix whose windows are cached too
            if all(self.pools[g].lookup(h) is not None for g in sliding
                   for h in hashes[self._first_needed(g, n * self.block_size):n]):
                break
        else:
            return PrefixHit()
        blocks = []
        for g, pool in enumerate(self.pools):
            first = self._first_needed(g, n * self.block_size)
            blocks.append([None] * first + [pool.lookup(h) for h in hashes[first:n]])
        return PrefixHit(n, blocks)

    def allocate(self, request: Request, num_new_tokens: int,
                 cached: PrefixHit | None = None, register: bool = True) -> bool:
        """Room for ``num_new_tokens`` beyond what the request has computed (plus the
        ``cached`` prefix hits it is about to adopt). False, changing nothing, if a pool
        cannot supply it. Blocks a sliding group's window has left behind go back first.
        The full blocks it fills become findable by prefix now, or (``register``
        False: their content is still on its way) at its next allocation.
        """
        held = self._held.get(request.request_id)
        num_cached = cached.num_blocks if cached else 0
        start = request.num_computed_tokens + num_cached * self.block_size
        num_tokens = start + num_new_tokens
        last = self.blocks_for(num_tokens)
        plans = []
        for g, pool in enumerate(self.pools):
            h = held[g] if held is not None else None
            num_held = len(h.blocks) if h is not None else 0
            first = self._first_needed(g, start)
            hits = cached.blocks[g] if cached and cached.num_blocks else []
            if h is not None and first > 0:
                self._trim(h, pool, first)
            have = max(num_held + len(hits), first)
            needed = max(0, last - have)
            touched = [b for b in hits if b is not None]
            reclaimed = sum(1 for b in touched if b.ref_cnt == 0)
            if needed > pool.num_free - reclaimed:
                return False
            plans.append((first, hits, touched, needed))
        if held is None:
            held = self._held[request.request_id] = [_Held() for _ in self.groups]
        for g, (pool, (first, hits, touched, needed)) in enumerate(
                zip(self.pools, plans, strict=True)):
            h = held[g]
            pool.touch(touched)
            if touched:
                for b in touched:
                    b.hits += 1
                if self.on_hit is not None:
                    self.on_hit(g, touched)
            h.blocks.extend(hits)
            h.ids.extend(NULL_BLOCK_ID if b is None else b.block_id for b in hits)
            gap = first - len(h.blocks)
            if gap > 0:  # out of the window before it was ever needed
                h.blocks.extend([None] * gap)
                h.ids.extend([NULL_BLOCK_ID] * gap)
            if needed > 0:
                new = pool.allocate(needed)
                h.blocks.extend(new)
                h.ids.extend(b.block_id for b in new)
        if self.enable_prefix_caching and register:
            full = min(num_tokens, request.num_tokens) // self.block_size
            if any(h.registered < full for h in held):  # blocks this step fills: findable
                hashes = self.hasher.update(request)
                for pool, h in zip(self.pools, held, strict=True):
                    for i in range(h.registered, full):
                        b = h.blocks[i]
                        if b is not None:
                            pool.register(b, hashes[i])
                    h.registered = max(h.registered, full)
        return True

    def shortfall(self, request: Request, num_new_tokens: int,
                  cached: PrefixHit | None = None) -> list[int]:
        """Per group, the blocks ``allocate`` would lack for the same arguments (all
        zero: it would succeed); changes nothing."""
        held = self._held.get(request.request_id)
        num_cached = cached.num_blocks if cached else 0
        start = request.num_computed_tokens + num_cached * self.block_size
        last = self.blocks_for(start + num_new_tokens)
        out = []
        for g, pool in enumerate(self.pools):
            h = held[g] if held is not None else None
            first = self._first_needed(g, start)
            hits = cached.blocks[g] if cached and cached.num_blocks else []
            trimmed = (sum(1 for b in h.blocks[:first] if b is not None and b.ref_cnt == 1)
                       if h is not None else 0)
            have = max((len(h.blocks) if h is not None else 0) + len(hits), first)
            reclaimed = sum(1 for b in hits if b is not None and b.ref_cnt == 0)
            out.append(max(0, max(0, last - have) - (pool.num_free - reclaimed + trimmed)))
        return out

    def registered_blocks(self, request: Request) -> int:
        """The request's leading blocks findable by hash (full, their content in)."""
        held = self._held.get(request.request_id)
        return held[0].registered if held is not None else 0

    def held_blocks(self, request: Request, group: int) -> list[KVBlock | None]:
        """The request's blocks in a group, in token order (read-only; a sliding group's
        past its window are None)."""
        held = self._held.get(request.request_id)
        return held[group].blocks if held is not None else []

    def releasable(self, request: Request) -> list[int]:
        """Per group, the blocks freeing the request would give back (those no other
        request shares)."""
        held = self._held.get(request.request_id)
        if held is None:
            return [0] * len(self.pools)
        return [sum(1 for b in h.blocks if b is not None and b.ref_cnt == 1) for h in held]

    @staticmethod
    def _trim(h: _Held, pool: BlockPool, first: int) -> None:
        """Give back a sliding group's blocks before ``first`` (newest first, so the
        older ones are evicted first)."""
        gone = [b for b in h.blocks[:first] if b is not None]
        if not gone:
            return
        pool.free(gone)
        for i in range(min(first, len(h.blocks))):
            h.blocks[i] = None
            h.ids[i] = NULL_BLOCK_ID

    def forget_from(self, request: Request, first_block: int) -> None:
        """Withdraw the prefix-cache registration of the request's blocks from
        ``first_block`` on: they were registered for content that never arrived."""
        held = self._held.get(request.request_id)
        if held is None:
            return
        for pool, h in zip(self.pools, held, strict=True):
            for b in h.blocks[first_block:h.registered]:
                if b is not None:
                    pool.unregister(b)
            h.registered = min(h.registered, first_block)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past its first ``num_tokens`` tokens (the
        positions of rejected draft tokens), in every group. They were never made
        findable by hash: only blocks full of the request's own tokens are."""
        held = self._held.get(request.request_id)
        if held is None:
            return
        keep = self.blocks_for(num_tokens)
        for pool, h in zip(self.pools, held, strict=True):
            if len(h.blocks) <= keep:
                continue
            gone = [b for b in h.blocks[keep:] if b is not None]
            del h.blocks[keep:]
            del h.ids[keep:]
            pool.free(gone)
            h.registered = min(h.registered, keep)

    def pin(self, request: Request) -> list[list[KVBlock]]:
        """One more reference on each of the request's blocks, so they keep their content
        after the request ends (a pool put still reading them); ``unpin`` gives it back."""
        held = self._held.get(request.request_id)
        if held is None:
            return []
        pinned = []
        for pool, h in zip(self.pools, held, strict=True):
            blocks = [b for b in h.blocks if b is not None]
            pool.touch(blocks)
            pinned.append(blocks)
        return pinned

    def unpin(self, pinned: list[list[KVBlock]]) -> None:
        for pool, blocks in zip(self.pools, pinned, strict=False):
            pool.free(blocks)

    def free(self, request: Request) -> None:
        if self.on_free is not None and request.request_id in self._held:
            self.on_free(request)
        held = self._held.pop(request.request_id, None)
        if held is not None:
            for pool, h in zip(self.pools, held, strict=True):
                pool.free([b for b in h.blocks if b is not None])

    def reset_prefix_cache(self) -> None:
        for pool in self.pools:
            pool.reset_prefix_cache()

    def usage(self) -> dict[str, tuple[int, int]]:
        """Per group: (free blocks, usable blocks)."""
        return {g.name: (p.num_free, p.num_blocks) for g, p in zip(self.groups, self.pools,
                                                                     strict=True)}
