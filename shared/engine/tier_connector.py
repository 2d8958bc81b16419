"""The engine's side of the KV tiers (kv_tiers.py): what reads them and what fills them.

    TierConnector   the scheduler's pool connector when tiers are on: a waiting prompt's
                    blocks past its L1 hits come from the tiers (L2, L3 through L2) as
                    far as they hold them, then from the mesh's KV pool (if any) as a
                    ``PoolConnector`` reads it; a prefill's puts go to the mesh's pool
    TierWrites      fills L2 as --hicache-write-policy says: on L1's evictions
                    (write_back), on L1's hits (write_through_selective), or after each
                    step, with the full blocks it computed (write_through)
"""

from __future__ import annotations

import logging

from pdmesh.shared.engine.block_manager import KVBlock, KVCacheManager
from pdmesh.shared.engine.kv_connector import PoolConnector, group_tables
from pdmesh.shared.engine.kv_tiers import SELECTIVE_HITS, HostTier
from pdmesh.shared.engine.request import Request
from pdmesh.shared.engine.step_hooks import StepHook, StepRecord
from pdmesh.shared.kvpool.base import CacheRegions, KVPool

log = logging.getLogger(__name__)


class TierConnector(PoolConnector):
    def __init__(self, tier: HostTier, pool: KVPool | None, regions: list[CacheRegions],
                 hasher, fingerprint: str, save_prompts: bool,
                 windows: list[int | None] | None = None, names: list[str] | None = None):
        """``pool``: the mesh's KV pool, or None (a mixed instance: the tiers alone)."""
        self.tier = tier
        super().__init__(pool, regions, hasher, fingerprint, save_prompts and pool is not None,
                         windows, names)
        # request id -> (local tokens, tokens the tiers held past them) as admission last
        # counted them: its load takes them from there
        self._counted: dict[str, tuple[int, int]] = {}

    def tier_tokens(self, request: Request, local_tokens: int) -> int:
        """Tokens past ``local_tokens`` (block aligned) the tiers hold, in whole blocks,
        leaving the last token to compute; where the model has sliding groups, the
        windows where it continues must be there too (else none)."""
        bs = self.block_size
        hashes = self.hasher.update(request)
        first, limit = local_tokens // bs, (request.num_tokens - 1) // bs
        keys = [self.key(0, h) for h in hashes[first:limit]]
        n = 0
        for found in self.tier.holds(keys, [0] * len(keys)):
            if not found:
                break
            n += 1
        if n and len(self.groups) > 1:
            keys, blocks = self._tier_plan(hashes[:first + n], None, first)
            if not all(self.tier.holds(keys, [g for g, _ in blocks])):
                return 0
        return n * bs

    def _tier_plan(self, hashes: list[bytes], tables: list[list[int]] | None, first: int
                   ) -> tuple[list[str], list[tuple[int, int]]]:
        """``_plan`` for blocks ``first ..`` of ``hashes`` (block index 0 for every
        block without ``tables``), the request continuing after them."""
        n = len(hashes)
        return self._plan([self.key(0, h) for h in hashes],
                          tables or [[0] * n] * len(self.groups), first, n * self.block_size)

    def loadable_tokens(self, request: Request, local_tokens: int) -> int:
        n = self.tier_tokens(request, local_tokens)
        if len(self._counted) > 4096:  # (requests aborted between admission and load)
            self._counted.clear()
        self._counted[request.request_id] = (local_tokens, n)
        if self.pool is not None:
            n += super().loadable_tokens(request, local_tokens + n)
        return n

    def load(self, request: Request, block_ids: list[int] | list[list[int]],
             start_token: int, num_tokens: int, off_step: bool = False) -> int:
        """The tiers' blocks first, then the mesh pool's for the rest; the tokens read
        (``PoolConnector.load``: whole blocks up to the first missing one)."""
        tables = group_tables(block_ids)
        local, held = self._counted.pop(request.request_id, (None, 0))
        if local != start_token:
            held = self.tier_tokens(request, start_token)
        n = min(num_tokens, held)
        if n:
            first = start_token // self.block_size
            hashes = self.hasher.update(request)[:first + n // self.block_size]
            keys, blocks = self._tier_plan(hashes, tables, first)
            read = self.read_tokens(request, "the KV tiers", self.tier.get(keys, blocks), n)
            if read < n:
                return read
        if n == num_tokens or self.pool is None:
            return n
        return n + super().load(request, block_ids, start_token + n, num_tokens - n,
                                off_step)

    def close(self) -> None:
        super().close()
        self.tier.close()


class TierWrites(StepHook):
    """Fills L2 from L1 as the write policy says (on the step thread)."""

    def __init__(self, connector: TierConnector, kv: KVCacheManager, policy: str):
        self.connector = connector
        self.tier = connector.tier
        self.kv = kv
        self.policy = policy
        self._written: dict[str, int] = {}  # request id -> its leading blocks written
        if policy == "write_back":
            kv.on_evict = self._evicted
        elif policy == "write_through_selective":
            kv.on_hit = self._hit

    def _evicted(self, group: int, blocks: list[KVBlock]) -> None:
        """L1 is about to reuse these blocks: their content goes to L2 first."""
        self._put(group, blocks)

    def _hit(self, group: int, blocks: list[KVBlock]) -> None:
        self._put(group, [b for b in blocks if b.hits == SELECTIVE_HITS])

    def _put(self, group: int, blocks: list[KVBlock]) -> None:
        if blocks:
            self._copy([self.connector.key(group, b.block_hash) for b in blocks],
                       [(group, b.block_id) for b in blocks])

    def _copy(self, keys: list[str], blocks: list[tuple[int, int]]) -> None:
        """Into L2; a failure is a block not kept, never a failed step."""
        try:
            self.tier.put(keys, blocks)
        except Exception:  # noqa: BLE001 (the tiers only ever save work)
            log.exception("kv tiers: copying %d blocks to host memory failed", len(keys))

    def executed(self, step: StepRecord) -> None:
        """write_through: the full blocks this step computed (their requests' blocks
        are still held: the update may free them)."""
        if self.policy != "write_through":
            return
        keys: list[str] = []
        blocks: list[tuple[int, int]] = []
        for req in step.sched.requests:
            done = self.kv.registered_blocks(req)
            start = self._written.get(req.request_id, 0)
            if done <= start:
                continue
            hashes = req.block_hashes
            for g in range(len(self.kv.groups)):
                for i, b in enumerate(self.kv.held_blocks(req, g)[start:done], start):
                    if b is not None:
                        keys.append(self.connector.key(g, hashes[i]))
                        blocks.append((g, b.block_id))
            self._written[req.request_id] = done
        if keys:
            self._copy(keys, blocks)

    def updated(self, step: StepRecord) -> None:
        for req in step.finished:
            self._written.pop(req.request_id, None)
        if len(self._written) > 2 * len(step.sched.requests) + 64:  # (aborted ones)
            live = {r.request_id for r in step.sched.requests}
            self._written = {k: v for k, v in self._written.items() if k in live}
