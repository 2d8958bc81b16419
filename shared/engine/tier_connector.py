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
from pdmesh.shared.engine.kv_connector import PoolConnector
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
        self.mesh = pool
        super().__init__(pool if pool is not None else _NoPool(), regions, hasher,
                         fingerprint, save_prompts and pool is not None, windows, names)

    def key(self, group: int, block_hash: bytes) -> str:
        """The pool key of a cache group's block."""
        key = f"{self.prefix}/{block_hash.hex()}"
        return key if group == 0 else f"{key}/{self.names[group]}"

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
            keys, blocks = self._plan_keys(hashes[:first + n], first)
            if not all(self.tier.holds(keys, [g for g, _ in blocks])):
                return 0
        return n * bs

    def _plan_keys(self, hashes: list[bytes], first: int
                   ) -> tuple[list[str], list[tuple[int, int]]]:
        """Every group's keys and (group, block index) for blocks ``first ..`` of
        ``hashes``, where the request continues after them."""
        end = len(hashes) * self.block_size
        keys, blocks = [], []
        for g in range(len(self.groups)):
            for b in range(max(first, self._first_block(g, end)), len(hashes)):
                keys.append(self.key(g, hashes[b]))
                blocks.append((g, b))
        return keys, blocks

    def loadable_tokens(self, request: Request, local_tokens: int) -> int:
        n = self.tier_tokens(request, local_tokens)
        if self.mesh is not None:
            n += super().loadable_tokens(request, local_tokens + n)
        return n

    def load(self, request: Request, block_ids: list[int] | list[list[int]],
             start_token: int, num_tokens: int, off_step: bool = False) -> bool:
        """The tiers' blocks first, then the mesh pool's for the rest (all or nothing:
        False leaves the whole range to compute)."""
        tables = block_ids if block_ids and isinstance(block_ids[0], list) else [block_ids]
        n = min(num_tokens, self.tier_tokens(request, start_token))
        if n:
            first = start_token // self.block_size
            hashes = self.hasher.update(request)[:first + n // self.block_size]
            keys, where = self._plan_keys(hashes, first)
            found = self.tier.get(keys, [(g, tables[g][b]) for g, b in where])  # type: ignore[index]
            if not all(found):
                log.warning("request %s: %d of %d blocks left the KV tiers; recomputing",
                            request.request_id, len(found) - sum(found), len(found))
                return False
        if n == num_tokens:
            return True
        if self.mesh is None:
            return False
        return super().load(request, block_ids, start_token + n, num_tokens - n, off_step)

    def close(self) -> None:
        super().close()
        self.tier.close()


class _NoPool(KVPool):
    """The mesh pool of an instance without one: holds nothing."""

    def exists(self, keys):
        return [False] * len(keys)

    def put(self, keys, regions):
        return [False] * len(keys)

    def get(self, keys, regions):
        return [False] * len(keys)

    def clear(self):
        return 0

    def stats(self):
        from pdmesh.shared.kvpool.base import PoolStats

        return PoolStats(0, 0, 0, 0)


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
