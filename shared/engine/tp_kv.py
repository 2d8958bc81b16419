"""KV between a tensor-parallel engine's ranks and the KV pool, in the pool's one layout.

A pool value is a block of the whole model's cache (every K / V head, as a TP1 engine
holds it), whatever the tensor-parallel size of the engine that wrote it, and the keys'
fingerprint is the whole model's cache layout: a prefill instance at TP a and a decode
instance at TP b exchange blocks, as two TP1 instances do (issue 19, "heterogeneous PD").

Rank r holds heads ``Shard(r, N).kv_heads(H)`` of each cache tensor of H heads (an even
share, or one head replicated past H ranks; MLA's latent, H = 1, on every rank). Rank 0
talks to the pool through a staging area of whole blocks, registered once:

    put     rank 0 tells the ranks which blocks; each sends its heads of them (one
            gather); rank 0 lays them side by side in staging and puts from there
    get     rank 0 gets into staging, then sends each rank its heads of the blocks found
            (one scatter); each writes them into its own cache

The staging area is cut into lanes: lane 0 for transfers on the step thread (a prefill
instance's puts), one per read beside the steps (``PromptLoads``, KV_LOAD_THREADS). A
read there fills its lane from the pool on its helper thread while the engine steps,
then hands the scatter to the step thread (``pump``, between two steps: the collectives
keep the ranks' order) and waits for it before its next chunk. A transfer larger than a
lane goes in chunks of it.
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

from pdmesh.shared.engine.block_manager import BlockHasher
from pdmesh.shared.engine.kv_cache_spec import KVCacheSpec
from pdmesh.shared.engine.kv_connector import PoolConnector
from pdmesh.shared.engine.prompt_loads import KV_LOAD_THREADS
from pdmesh.shared.kvpool.base import CacheRegions, KVPool
from pdmesh.shared.parallel.tensor_parallel import Shard
from pdmesh.shared.parallel.tp_ranks import Groups

STAGING_BYTES = 64 << 20  # the staging area: at most this much, at least a block a lane
LANES = 1 + KV_LOAD_THREADS  # the step thread's, and one per read beside the steps


def _pack(tensors: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The blocks ``ids`` of each tensor, as bytes, one tensor after the other."""
    index = torch.tensor(ids, dtype=torch.int64, device=tensors[0].device)
    return torch.cat([t.index_select(0, index).contiguous().view(-1).view(torch.uint8)
                      for t in tensors])


def _unpack(flat: torch.Tensor, tensors: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """``_pack``'s bytes back as [n, *block shape] per tensor (views of ``flat``)."""
    out, at = [], 0
    for t in tensors:
        size = n * t[0].numel() * t.element_size()
        out.append(flat[at:at + size].view(t.dtype).view(n, *t.shape[1:]))
        at += size
    return out


def worker_transfer(body: tuple, caches: list[list[torch.Tensor]], groups: Groups) -> None:
    """A worker rank's side of one transfer: ("out", group, ids) sends its heads of those
    blocks to rank 0; ("in", group, ids) receives them and writes them in."""
    direction, group, ids = body
    tensors = caches[group]
    if direction == "out":
        dist.gather(_pack(tensors, ids), None, dst=groups.src, group=groups.tp)
        return
    flat = torch.empty(len(ids) * sum(t[0].numel() * t.element_size() for t in tensors),
                       dtype=torch.uint8, device=tensors[0].device)
    dist.scatter(flat, None, src=groups.src, group=groups.tp)
    index = torch.tensor(ids, dtype=torch.int64, device=tensors[0].device)
    for t, part in zip(tensors, _unpack(flat, tensors, len(ids)), strict=True):
        t.index_copy_(0, index, part)


class ShardedPoolConnector(PoolConnector):
    """Rank 0's connector in a tensor-parallel engine: the pool sees whole blocks
    (staging) while each rank keeps its heads."""

    def __init__(self, pool: KVPool, caches: list[list[torch.Tensor]], full: KVCacheSpec,
                 dtype: torch.dtype, tp_ranks, hasher: BlockHasher, fingerprint: str,
                 save_prompts: bool, windows: list[int | None] | None = None,
                 names: list[str] | None = None):
        """``caches``: rank 0's own, per group; ``full``: the whole model's cache spec
        (the pool's layout)."""
        self.caches = caches
        self.tp_ranks = tp_ranks
        self.size = tp_ranks.size
        block_bytes = max(g.block_bytes(dtype) for g in full.groups if g.tensors)
        self.lane_blocks = max(1, STAGING_BYTES // LANES // max(block_bytes, 1))
        self.staging_blocks = LANES * self.lane_blocks
        self.staging: list[list[torch.Tensor]] = []
        self._free_lanes: queue.Queue[int] = queue.Queue()
        for lane in range(1, LANES):
            self._free_lanes.put(lane)
        # scatters the reads beside the steps left to the step thread: (group, staging
        # slots, block ids, set once done)
        self._handed: queue.Queue[tuple[int, list[int], list[int], threading.Event]] = \
            queue.Queue()
        self._closed = threading.Event()
        # per group and tensor: the heads each rank holds
        self.heads: list[list[list[slice]]] = []
        for g, (group, mine) in enumerate(zip(full.groups, caches, strict=True)):
            tensors, heads = [], []
            for t, local in zip(group.tensors, mine, strict=True):
                tensors.append(torch.zeros((self.staging_blocks, t.slots, t.heads, t.dim),
                                           dtype=local.dtype, device=local.device))
                owned = [Shard(r, self.size).kv_heads(t.heads) for r in range(self.size)]
                if owned[0].stop - owned[0].start != local.shape[2]:
                    raise ValueError(f"kv pool: cache group {g} tensor {t.role} of layer "
                                     f"{t.layer} holds {local.shape[2]} heads on rank 0, "
                                     f"its shard is {owned[0]}")
                heads.append(owned)
            self.staging.append(tensors)
            self.heads.append(heads)
        super().__init__(pool, [CacheRegions(t) for t in self.staging], hasher, fingerprint,
                         save_prompts, windows=windows, names=names)

    def _transfer(self, direction: str, keys: list[str], blocks: list[tuple[int, int]],
                  off_step: bool = False) -> list[bool]:
        if not off_step:
            return self._through(0, direction, keys, blocks)
        assert direction == "get", "puts run on the step thread"
        lane = self._free_lanes.get()  # (as many lanes as reads run at once)
        try:
            return self._through(lane, direction, keys, blocks)
        finally:
            self._free_lanes.put(lane)

    def _through(self, lane: int, direction: str, keys: list[str],
                 blocks: list[tuple[int, int]]) -> list[bool]:
        """The transfer through staging lane ``lane`` (0: on the step thread)."""
        ok: list[bool] = []
        first = lane * self.lane_blocks
        for g in range(len(self.groups)):  # group by group, in chunks of the lane
            mine = [i for i, (gi, _) in enumerate(blocks) if gi == g]
            for at in range(0, len(mine), self.lane_blocks):
                chunk = mine[at:at + self.lane_blocks]
                ids = [blocks[i][1] for i in chunk]
                slots = [(g, first + s) for s in range(len(chunk))]
                ckeys = [keys[i] for i in chunk]
                if direction == "put":
                    self._gather(g, ids)
                    done = super()._transfer("put", ckeys, slots)
                else:
                    done = super()._transfer("get", ckeys, slots)
                    found = [(first + s, b)
                             for s, (b, hit) in enumerate(zip(ids, done, strict=True)) if hit]
                    if found:
                        where = ([s for s, _ in found], [b for _, b in found])
                        if lane:
                            self._hand_over(g, *where)
                        else:
                            self._scatter(g, *where)
                ok += list(zip(chunk, done, strict=True))
        return [hit for _, hit in sorted(ok)]

    def _hand_over(self, g: int, slots: list[int], ids: list[int]) -> None:
        """(A read beside the steps) the scatter of what its lane holds, by the step
        thread; back once it is done (the lane is then free for the next chunk)."""
        done = threading.Event()
        self._handed.put((g, slots, ids, done))
        while not done.wait(0.1):
            if self._closed.is_set():
                raise ConnectionError("the engine stopped while the read ran")

    def pump(self) -> None:
        while True:
            try:
                g, slots, ids, done = self._handed.get_nowait()
            except queue.Empty:
                return
            try:
                self._scatter(g, slots, ids)
            finally:
                done.set()

    def close(self) -> None:
        self._closed.set()

    def _gather(self, g: int, ids: list[int]) -> None:
        """Blocks ``ids`` of every rank, side by side in staging slots 0 .. len(ids)."""
        self.tp_ranks.broadcast(("kv", ("out", g, ids)))
        flat = _pack(self.caches[g], ids)
        parts = [torch.empty_like(flat) for _ in range(self.size)]
        groups = self.tp_ranks.groups
        dist.gather(flat, parts, dst=groups.src, group=groups.tp)
        n = len(ids)
        for r, part in enumerate(parts):
            for t, (stage, block) in enumerate(zip(self.staging[g],
                                                   _unpack(part, self.caches[g], n),
                                                   strict=True)):
                stage[:n, :, self.heads[g][t][r]] = block

    def _scatter(self, g: int, slots: list[int], ids: list[int]) -> None:
        """Staging slots ``slots`` into blocks ``ids``: each rank its heads."""
        self.tp_ranks.broadcast(("kv", ("in", g, ids)))
        index = torch.tensor(slots, dtype=torch.int64, device=self.staging[g][0].device)
        parts = [torch.cat([stage.index_select(0, index)[:, :, self.heads[g][t][r]]
                            .contiguous().view(-1).view(torch.uint8)
                            for t, stage in enumerate(self.staging[g])])
                 for r in range(self.size)]
        mine = torch.empty_like(parts[0])
        groups = self.tp_ranks.groups
        dist.scatter(mine, parts, src=groups.src, group=groups.tp)
        where = torch.tensor(ids, dtype=torch.int64, device=mine.device)
        for t, part in zip(self.caches[g], _unpack(mine, self.caches[g], len(ids)),
                           strict=True):
            t.index_copy_(0, where, part)
