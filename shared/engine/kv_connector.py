"""Moving a request's KV between the engine's paged cache and the KV pool.

Two moments in a request's life, as in vLLM's KV-connector design:

    admission   the scheduler asks how many of the request's leading tokens, beyond
                its local prefix-cache hits, the pool can supply; it allocates blocks
                for them and the connector loads them (a decode instance loads a whole
                prefilled prompt this way; a prefill instance loads a shared prefix)
    prompt done the step that computes a request's last prompt token saves the prompt's
                blocks (full blocks, and the partial tail block) to the pool, and
                records their keys on the request

Pool keys are ``<fingerprint>/<hash>``: the chained block hash of the engine's prefix
cache for a full block, and, for the partial tail, the same chain extended by the tail's
tokens (a different byte length, so it never collides with a full block's key).

A model with several cache groups (DeepSeek-V4: compressed history, sliding window)
moves each group's blocks under its own keys, ``<fingerprint>/<hash>/<group>`` past the
first group; a sliding group moves only the blocks its window needs where the request
continues.
"""

from __future__ import annotations

import logging
import time

from pdmesh.shared.engine.block_manager import BlockHasher
from pdmesh.shared.engine.request import Request
from pdmesh.shared.kvpool.base import CacheRegions, KVPool, keep_time

log = logging.getLogger(__name__)


def group_tables(block_ids: list[int] | list[list[int]]) -> list[list[int]]:
    """A request's block table per cache group, from one table or one per group."""
    if block_ids and isinstance(block_ids[0], list):
        return block_ids  # type: ignore[return-value]
    return [block_ids]  # type: ignore[list-item]


class PoolConnector:
    def __init__(self, pool: KVPool | None, regions: CacheRegions | list[CacheRegions],
                 hasher: BlockHasher, fingerprint: str, save_prompts: bool,
                 windows: list[int | None] | None = None, names: list[str] | None = None):
        """``regions``: per cache group (one for most models); ``windows``: per group,
        None for a history group or the tokens a sliding group keeps; ``pool`` None:
        no mesh pool (a subclass reads its own tiers, and nothing is saved)."""
        self.pool = pool
        self.groups = regions if isinstance(regions, list) else [regions]
        self.regions = self.groups[0]
        self.windows = windows or [None] * len(self.groups)
        self.names = names or [str(g) for g in range(len(self.groups))]
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.prefix = fingerprint
        self.save_prompts = save_prompts
        for group in self.groups if pool is not None else ():
            for t in group.tensors:
                pool.register(t)
        # transfers, for metrics: direction -> [bytes, seconds of each transfer]
        self.transfer_bytes = {"put": 0, "get": 0}
        self.transfer_seconds: dict[str, list[float]] = {"put": [], "get": []}

    def take_transfer_seconds(self, direction: str) -> list[float]:
        """The transfer times recorded since the last call (the metrics collector's)."""
        taken, self.transfer_seconds[direction] = self.transfer_seconds[direction], []
        return taken

    def _account(self, direction: str, blocks: list[tuple[int, int]], ok: list[bool],
                 seconds: float) -> int:
        """Record a transfer; returns its bytes."""
        moved = sum(self.groups[g].value_bytes
                    for (g, _), done in zip(blocks, ok, strict=True) if done)
        self.transfer_bytes[direction] += moved
        keep_time(self.transfer_seconds[direction], seconds)
        return moved

    def prompt_keys(self, request: Request, num_tokens: int) -> list[str]:
        """Pool keys covering the request's first ``num_tokens`` tokens, in block order."""
        bs = self.block_size
        hashes = self.hasher.update(request)
        full = num_tokens // bs
        keys = [self.key(0, h) for h in hashes[:full]]
        tail = request.token_ids[full * bs:num_tokens]
        if tail:
            parent = hashes[full - 1] if full else self.hasher.root_of(request)
            keys.append(self.key(0, self.hasher.hash_block(parent, tail)))
        return keys

    def key(self, group: int, block_hash: bytes) -> str:
        """The pool key of a cache group's block (the same in every tier and instance)."""
        return self.in_group(group, f"{self.prefix}/{block_hash.hex()}")

    def in_group(self, group: int, key: str) -> str:
        """Group 0's key of a block as ``group``'s."""
        return key if group == 0 else f"{key}/{self.names[group]}"

    def _first_block(self, group: int, next_token: int) -> int:
        """The first block a group must supply when the request continues at
        ``next_token`` (every block for a history group)."""
        window = self.windows[group]
        return 0 if window is None else max(0, next_token - window) // self.block_size

    def _plan(self, keys: list[str], tables: list[list[int]], first: int, end: int
              ) -> tuple[list[str], list[tuple[int, int]]]:
        """Every group's keys and (group, block id) for blocks ``first ..`` of a request
        that continues at token ``end``."""
        all_keys: list[str] = []
        blocks: list[tuple[int, int]] = []
        for g, group in enumerate(self.groups):
            if not group.tensors:
                continue
            lo = max(first, self._first_block(g, end))
            for b in range(lo, len(keys)):
                all_keys.append(self.in_group(g, keys[b]))
                blocks.append((g, tables[g][b]))
        return all_keys, blocks

    def _transfer(self, direction: str, keys: list[str], blocks: list[tuple[int, int]],
                  off_step: bool = False) -> list[bool]:
        """Put the blocks under their keys, or get the keys into them: per key, whether
        it is in the pool now / was found. (A tensor-parallel engine stages them:
        ``ShardedPoolConnector``; ``off_step``: called beside the steps, not in one.)"""
        regions = [self.groups[g].regions(b) for g, b in blocks]
        return (self.pool.put if direction == "put" else self.pool.get)(keys, regions)

    def pump(self) -> None:
        """On the step thread: finish what reads beside the steps left to it (a tensor-
        parallel engine hands its ranks their heads of the blocks read there). Called
        between steps while reads run; nothing for one engine."""

    def close(self) -> None:
        """The engine stops: reads still running give up."""

    def loadable_tokens(self, request: Request, local_tokens: int) -> int:
        """Tokens past ``local_tokens`` (block aligned) that the pool can supply, leaving
        the last token to compute."""
        limit = request.num_tokens - 1
        if limit <= local_tokens:
            return 0
        keys = self.prompt_keys(request, limit)
        first = local_tokens // self.block_size
        try:
            hits = self.pool.prefix_hits(keys[first:])
            end = min(limit, (first + hits) * self.block_size)
            if hits and len(self.groups) > 1:  # the windows where it continues, too
                needed, _ = self._plan(keys[:first + hits], [[0] * (first + hits)]
                                       * len(self.groups), first, end)
                if not all(self.pool.exists(needed)):
                    return 0
        except ConnectionError as e:  # the pool is down: compute everything here
            log.warning("request %s: pool lookup failed (%s)", request.request_id, e)
            return 0
        return end - local_tokens

    def load(self, request: Request, block_ids: list[int] | list[list[int]],
             start_token: int, num_tokens: int, off_step: bool = False) -> int:
        """Copy tokens [start_token, start_token + num_tokens) in from the pool; returns
        the tokens read from ``start_token`` on: all of them, or (blocks gone) the whole
        blocks before the first missing one (none where the model has sliding groups).
        ``block_ids``: the request's table, or one per cache group; ``off_step``: on a
        helper thread beside the steps (``pump`` then runs between them)."""
        bs = self.block_size
        tables = group_tables(block_ids)
        first, end = start_token // bs, start_token + num_tokens
        keys, blocks = self._plan(self.prompt_keys(request, end), tables, first, end)
        t0 = time.perf_counter()
        try:
            ok = self._transfer("get", keys, blocks, off_step)
        except ConnectionError as e:
            log.warning("request %s: pool load failed (%s); recomputing", request.request_id, e)
            return 0
        request.kv_get_bytes = self._account("get", blocks, ok, time.perf_counter() - t0)
        return self.read_tokens(request, "the pool", ok, num_tokens)

    def read_tokens(self, request: Request, source: str, found: list[bool],
                    num_tokens: int) -> int:
        """What a read of ``num_tokens`` whose blocks were ``found`` (in ``_plan``'s
        order) brought: all of them, else the whole blocks before the first missing one
        (one cache group; with several, none)."""
        if all(found):
            return num_tokens
        kept = 0
        if len(self.groups) == 1:
            while found[kept]:
                kept += 1
        log.warning("request %s: %d of %d blocks missing from %s; computing from block %d "
                    "of the read on", request.request_id, len(found) - sum(found), len(found),
                    source, kept)
        return kept * self.block_size

    def save(self, request: Request, block_ids: list[int] | list[list[int]],
             num_tokens: int | None = None) -> list[str]:
        """Put the prompt's blocks in the pool (a sliding group's: those its window needs
        where the request continues); returns their keys (all of them, also those the
        pool already had). ``block_ids``: the request's table, or one per cache group;
        ``num_tokens``: the tokens they hold (default: all the request's - the prompt,
        and any output tokens it came with, a re-prefill)."""
        tables = group_tables(block_ids)
        end = request.num_tokens if num_tokens is None else num_tokens
        keys, blocks = self._plan(self.prompt_keys(request, end), tables, 0, end)
        t0 = time.perf_counter()
        try:
            stored = self._transfer("put", keys, blocks)
        except ConnectionError as e:  # decode will find nothing and compute the prompt
            log.warning("request %s: pool save failed (%s)", request.request_id, e)
            return keys
        request.kv_put_bytes = self._account("put", blocks, stored,
                                             time.perf_counter() - t0)
        if not all(stored):
            log.warning("request %s: pool refused %d of %d blocks", request.request_id,
                        len(stored) - sum(stored), len(stored))
        return keys
