"""Data-parallel attention with expert-parallel MoE layers, across the DP ranks of one
instance (one process per rank, torch.distributed between them: hccl on NPU, nccl on
CUDA, gloo on CPU).

Each rank owns its requests, KV cache and attention. Each MoE layer's experts live in
``num_slots`` physical slots (the logical experts plus ``num_redundant_experts``
replicas), ``slots_per_rank`` per rank; slot ``s`` is on rank ``s // slots_per_rank``.
A MoE layer on every rank, in lockstep:

    gate (local tokens) -> logical experts -> a replica's slot for each (token, choice)
    -> rows sorted by slot                       counts per slot  ──all_to_all──▶
    -> rows to the slots' ranks                  hidden rows      ──all_to_all──▶
    -> each rank runs its local slots' experts on what it received
    -> results back                              expert outputs   ──all_to_all──▶
    -> weighted sum per token (the single-process engine's order: by slot)

A rank with no work still runs ``idle_step`` so that every collective has all ranks.
Placements change live, one MoE layer per step (``apply_layer``): the slots a rank
gains are copied from the ranks that hold them (``move_experts``), then the layer's
maps switch between two steps, so no step mixes two placements.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from pdmesh.shared.infra.timeouts import collective_timeout_s
from pdmesh.shared.kernels.quant import (
    QuantExperts,
    expert_tensors,
    select_experts,
    with_expert_tensors,
)

log = logging.getLogger(__name__)


class ExpertStacks(Protocol):
    """A MoE layer's routed experts as a loaded model holds them, expert-major (the
    models' ``MoEWeights`` is one): float, or quantized with their scales."""

    w13: torch.Tensor | QuantExperts  # [E, hidden, 2I]  (gate | up)
    w2: torch.Tensor | QuantExperts  # [E, I, hidden]


def dist_backend(device: str) -> str:
    return {"npu": "hccl", "cuda": "nccl"}.get(device, "gloo")


def init_group(rank: int, world: int, master: str, device: str) -> None:
    """Join the instance's process group (``master`` = host:port of rank 0's store)."""
    host, _, port = master.rpartition(":")
    dist.init_process_group(dist_backend(device), init_method=f"tcp://{host}:{port}",
                            rank=rank, world_size=world,
                            timeout=timedelta(seconds=collective_timeout_s()))


def attach_expert_parallel(model, cfg, rank: int, world: int, num_redundant: int = 0,
                           expert_map_path: str | None = None) -> ExpertParallel:
    """Expert parallelism for a loaded model (``cfg``: the whole model's config): this
    rank (of ``world``, the group already joined) keeps only its slots; the full expert
    stacks go."""
    moe = cfg.moe
    moe_layers = model.moe_layers
    num_slots = moe.num_experts + num_redundant
    start = (load_expert_map(expert_map_path, len(moe_layers), moe.num_experts, num_slots)
             if expert_map_path else None)
    weights = [model.w.layers[i].mlp for i in moe_layers]
    ep = ExpertParallel(rank, world, moe_layers, weights, moe.num_experts, num_redundant,
                        start)
    if cfg.v4 is not None:
        ep.swiglu_limit = cfg.v4.swiglu_limit or None
    for w in weights:  # the full expert stacks are not needed any more
        w.w13 = select_experts(w.w13, torch.empty(0, dtype=torch.int64))
        w.w2 = select_experts(w.w2, torch.empty(0, dtype=torch.int64))
    model.ep = ep
    return ep


def identity_placement(num_layers: int, num_experts: int, num_slots: int) -> torch.Tensor:
    """phy2log [L, S] that a fresh instance starts from: slot s holds expert s % E, so the
    redundant slots repeat the first experts."""
    return (torch.arange(num_slots) % num_experts).repeat(num_layers, 1)


def load_expert_map(path: str | Path, num_layers: int, num_experts: int,
                    num_slots: int) -> torch.Tensor:
    """``expert_map_path``: JSON ``{"phy2log": [[expert of each slot] per MoE layer]}``
    (what ``expert_map_record_path`` writes). ValueError naming what does not fit."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"expert_map_path: cannot read {path}: {e}") from e
    table = raw.get("phy2log") if isinstance(raw, dict) else None
    if table is None:
        raise ValueError(f"expert_map_path: {path} has no 'phy2log' table")
    m = torch.tensor(table, dtype=torch.int64)
    if tuple(m.shape) != (num_layers, num_slots):
        raise ValueError(f"expert_map_path: phy2log is {list(m.shape)}, the model needs "
                         f"[{num_layers} MoE layers, {num_slots} slots]")
    validate_placement(m, num_experts)
    return m


def validate_placement(phy2log: torch.Tensor, num_experts: int) -> None:
    if phy2log.min() < 0 or phy2log.max() >= num_experts:
        raise ValueError(f"phy2log: expert ids must be in [0, {num_experts})")
    for layer, row in enumerate(phy2log):
        missing = set(range(num_experts)) - set(row.tolist())
        if missing:
            raise ValueError(f"phy2log: layer {layer} has no slot for expert(s) "
                             f"{sorted(missing)[:8]}")


@dataclass
class LayerPlacement:
    phy2log: torch.Tensor  # [S] logical expert of each slot
    log2phy: torch.Tensor  # [E, S] slots of each expert, -1 padded
    logcnt: torch.Tensor  # [E] replicas of each expert

    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor, num_experts: int) -> LayerPlacement:
        slots = phy2log.shape[0]
        logcnt = torch.bincount(phy2log, minlength=num_experts)
        log2phy = torch.full((num_experts, slots), -1, dtype=torch.int64)
        order = torch.argsort(phy2log, stable=True)  # slots grouped by expert, ascending
        rank_in_expert = torch.arange(slots) - torch.repeat_interleave(
            torch.cumsum(logcnt, 0) - logcnt, logcnt)
        log2phy[phy2log[order], rank_in_expert] = order
        return cls(phy2log.clone(), log2phy, logcnt)


class ExpertParallel:
    """The EP side of every MoE layer of one rank's model."""

    def __init__(self, rank: int, world: int, moe_layers: list[int],
                 experts: list[ExpertStacks], num_experts: int, num_redundant: int = 0,
                 phy2log: torch.Tensor | None = None):
        """``experts``: each MoE layer's full expert weights (this rank keeps only its
        slots); ``phy2log`` [L, S]: a start placement (default: identity)."""
        self.rank, self.world = rank, world
        self.swiglu_limit: float | None = None  # DeepSeek-V4's clamp, set by the engine
        self.num_experts = num_experts
        self.num_slots = num_experts + num_redundant
        if self.num_slots % world:
            raise ValueError(f"num_redundant_experts: experts + redundant ({self.num_slots}) "
                             f"must divide by the expert-parallel ranks ({world}: "
                             "data_parallel_size x tensor_parallel_size)")
        self.slots_per_rank = self.num_slots // world
        self.layer_index = {layer: i for i, layer in enumerate(moe_layers)}
        if phy2log is None:
            phy2log = identity_placement(len(moe_layers), num_experts, self.num_slots)
        validate_placement(phy2log, num_experts)
        self.version = 0
        self.placements = [LayerPlacement.from_phy2log(p, num_experts) for p in phy2log]
        # the maps the forward indexes with, on the experts' device (set with a placement,
        # not copied over every step)
        self._device = experts[0].w13.device if experts else torch.device("cpu")
        self._maps = [self._on_device(p) for p in self.placements]
        mine = slice(rank * self.slots_per_rank, (rank + 1) * self.slots_per_rank)
        # [slots_per_rank, H, 2I] and [slots_per_rank, I, H] per MoE layer: float, or
        # quantized with their scales (every tensor expert-major, moved alike)
        self.w13: list[torch.Tensor | QuantExperts] = []
        self.w2: list[torch.Tensor | QuantExperts] = []
        for w, p in zip(experts, self.placements, strict=True):
            local = p.phy2log[mine]
            self.w13.append(select_experts(w.w13, local))
            self.w2.append(select_experts(w.w2, local))
        self.bytes_moved = 0
        # a tensor-parallel engine's rank 0: tells its workers to run the same collective
        # (they hold slots of their own); None elsewhere
        self.announce = None

    def _on_device(self, p: LayerPlacement) -> tuple[torch.Tensor, torch.Tensor]:
        return p.log2phy.to(self._device), p.logcnt.to(self._device)

    # -- the forward ------------------------------------------------------------------
    def moe(self, layer: int, x: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, backend) -> torch.Tensor:
        """One MoE layer for this rank's tokens x [T, H] (T may be 0)."""
        i = self.layer_index[layer]
        dev = x.device
        top_k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)  # [T*k] logical experts
        n = flat.shape[0]
        # spread each expert's rows over its replicas
        log2phy, logcnt = self._maps[i]
        rep = torch.arange(n, device=dev) % logcnt[flat]
        slot = log2phy[flat, rep]
        order = torch.argsort(slot, stable=True)
        token_of = order // top_k
        send_x = x.index_select(0, token_of)
        per_slot = torch.bincount(slot, minlength=self.num_slots)  # [S]
        recv_per_slot = torch.empty_like(per_slot)
        dist.all_to_all_single(recv_per_slot, per_slot)  # [world * slots_per_rank]
        recv_mat = recv_per_slot.view(self.world, self.slots_per_rank)
        send_split = per_slot.view(self.world, self.slots_per_rank).sum(1).tolist()
        recv_split = recv_mat.sum(1).tolist()
        recv_x = x.new_empty((sum(recv_split), x.shape[1]))
        dist.all_to_all_single(recv_x, send_x, recv_split, send_split)
        # group what arrived (by source rank, then slot) by local slot
        local_slot = torch.repeat_interleave(
            torch.arange(self.slots_per_rank, device=dev).repeat(self.world),
            recv_mat.reshape(-1))
        by_slot = torch.argsort(local_slot, stable=True)
        sizes = recv_mat.sum(0).tolist()
        rows = recv_x.index_select(0, by_slot)
        h = backend.silu_and_mul(backend.grouped_matmul(rows, self.w13[i], sizes),
                                 self.swiglu_limit)
        y_sorted = backend.grouped_matmul(h, self.w2[i], sizes)
        y = torch.empty_like(y_sorted)
        y[by_slot] = y_sorted
        back = x.new_empty((n, x.shape[1]))
        dist.all_to_all_single(back, y, send_split, recv_split)
        back = back * topk_weights.reshape(-1)[order].unsqueeze(1).to(back.dtype)
        out = torch.zeros_like(x)
        out.index_add_(0, token_of, back)
        return out

    def idle_step(self, hidden_size: int, dtype: torch.dtype, device, backend) -> None:
        """Every MoE layer with no tokens of its own: serves the other ranks' tokens."""
        if self.announce is not None:
            self.announce(("idle", None))
        x = torch.empty((0, hidden_size), dtype=dtype, device=device)
        ids = torch.empty((0, 1), dtype=torch.int64, device=device)
        w = torch.empty((0, 1), dtype=torch.float32, device=device)
        for layer in self.layer_index:
            self.moe(layer, x, w, ids, backend)

    # -- placement changes ------------------------------------------------------------
    def move_experts(self, i: int, new_phy2log: torch.Tensor) -> int:
        """Fetch the weights of the slots this rank holds under ``new_phy2log`` (MoE layer
        index ``i``) from the ranks holding those experts now. Every rank calls this for
        the same layer and placement. Returns the bytes this rank received."""
        if self.announce is not None:
            self.announce(("ep_move", (i, new_phy2log)))
        old = self.placements[i].phy2log
        spr = self.slots_per_rank
        # for each new slot, where its expert comes from: a slot of the same rank that
        # already holds it, else the lowest old slot holding it
        src_slot = torch.empty(self.num_slots, dtype=torch.int64)
        for s in range(self.num_slots):
            expert = int(new_phy2log[s])
            base = (s // spr) * spr
            here = [o for o in range(base, base + spr) if int(old[o]) == expert]
            src_slot[s] = here[0] if here else int((old == expert).nonzero()[0])
        src_rank = src_slot // spr
        dst_rank = torch.arange(self.num_slots) // spr
        # what I send: rows for every (new slot on another rank) whose source is me,
        # ordered by destination rank then new slot; what I receive likewise
        send = [s for s in range(self.num_slots)
                if src_rank[s] == self.rank and dst_rank[s] != self.rank]
        recv = [s for s in range(self.num_slots)
                if dst_rank[s] == self.rank and src_rank[s] != self.rank]
        send.sort(key=lambda s: (int(dst_rank[s]), s))
        recv.sort(key=lambda s: (int(src_rank[s]), s))
        send_split = [sum(1 for s in send if dst_rank[s] == r) for r in range(self.world)]
        recv_split = [sum(1 for s in recv if src_rank[s] == r) for r in range(self.world)]
        moved = 0
        new_w = []
        for stacked in (self.w13[i], self.w2[i]):
            fresh_tensors = []
            for w in expert_tensors(stacked):
                fresh, n = self._exchange(w, send, recv, src_slot, send_split, recv_split)
                fresh_tensors.append(fresh)
                moved += n
            new_w.append(with_expert_tensors(stacked, fresh_tensors))
        self.w13[i], self.w2[i] = new_w
        self.placements[i] = LayerPlacement.from_phy2log(new_phy2log, self.num_experts)
        self._maps[i] = self._on_device(self.placements[i])
        self.bytes_moved += moved
        return moved

    def _exchange(self, w: torch.Tensor, send: list[int], recv: list[int],
                  src_slot: torch.Tensor, send_split: list[int], recv_split: list[int]
                  ) -> tuple[torch.Tensor, int]:
        """One expert-major tensor of a layer under the new placement: the rows for the
        slots in ``recv`` from their ranks, the others from this rank's old slots.
        Returns it and the bytes received."""
        spr = self.slots_per_rank
        local_old = [int(src_slot[s]) - self.rank * spr for s in send]
        out = w.new_empty((len(recv), *w.shape[1:]))
        dist.all_to_all_single(out, w[local_old].contiguous() if send else
                               w.new_empty((0, *w.shape[1:])), recv_split, send_split)
        fresh = w.new_empty(w.shape)
        got = dict(zip(recv, out, strict=True))
        for j in range(spr):
            s = self.rank * spr + j
            if s in got:
                fresh[j] = got[s]
            else:  # the expert was already here, in some local slot
                fresh[j] = w[int(src_slot[s]) - self.rank * spr]
        return fresh, out.numel() * out.element_size()
