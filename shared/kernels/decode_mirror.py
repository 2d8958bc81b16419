"""Dense copies of a decode batch's keys and values, carried from one step to the next.

Pure-torch paged attention gathers every sequence's cached keys and values into dense
[B, L, KVH, D] tensors, in every layer, every step: a copy of the whole KV of the batch.
In steady decoding the batch is the same sequences, each one token longer, so the
mirror keeps last step's dense copy per layer and appends the one new row per sequence:

    step t     rebuild: gather [B, cap] rows per layer (cap >= max seq_len; rows past a
               sequence's end read the zeroed null block)
    step t+1   same B, same leading block-table columns, every seq_len one longer?
                 yes -> mirror[b, seq_len_b - 1] = cache[new slot of b]    (B rows)
                 no  -> rebuild

A mirror is only a cache of what the paged cache holds; the paged cache stays the
source of truth, and any doubt means a rebuild.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

CAP_STEP = 64  # mirror length grows in steps of this many tokens
# A layer's mirror may take at most what that layer's paged cache takes (so the KV
# memory at most doubles), and all layers together at most this; beyond, plain gathers.
MAX_MIRROR_BYTES = 4 << 30


@dataclass
class _Layer:
    k: torch.Tensor  # [B * cap, KVH, D]
    v: torch.Tensor
    step: int  # the step whose keys it holds


@dataclass
class _Batch:
    tables: np.ndarray  # [B, nb] block tables of the step that last touched the mirror
    seq_lens: np.ndarray  # [B]
    cap: int
    layers: dict[int, _Layer] = field(default_factory=dict)  # by the cache's data_ptr
    nbytes: int = 0  # of all buffers so far


@dataclass
class MirrorPlan:
    """One decode step's use of the mirror, decided once in ``prepare_attention``."""

    rebuild: bool
    step: int
    cap: int
    key_slots: torch.Tensor | None  # rebuild: [B, cap] slots to gather
    new_rows: torch.Tensor | None  # append: [B] row of each new token in the [B*cap] buffer
    new_slots: torch.Tensor | None  # append: [B] cache slot of each new token


class DecodeKVMirror:
    def __init__(self) -> None:
        self._batch: _Batch | None = None
        self._step = 0
        self._too_big: tuple[int, int] | None = None  # (B, cap) that overflowed the budget
        self.rebuilds = 0  # steps that gathered the whole batch
        self.appends = 0  # steps that only appended a row per sequence

    def invalidate(self) -> None:
        self._batch = None

    def plan(self, tables: np.ndarray, seq_lens: np.ndarray, block_size: int,
             slot_mapping: torch.Tensor, device: torch.device) -> MirrorPlan | None:
        """None when this step should gather as usual."""
        self._step += 1
        b = self._batch
        lk = int(seq_lens.max())
        if (b is not None and b.seq_lens.shape == seq_lens.shape and lk <= b.cap
                and np.array_equal(seq_lens, b.seq_lens + 1)
                and tables.shape[1] >= b.tables.shape[1]
                and _same_blocks(b.tables, tables, b.seq_lens, block_size)):
            b.seq_lens, b.tables = seq_lens, tables
            self.appends += 1
            rows = np.arange(len(seq_lens)) * b.cap + seq_lens - 1
            return MirrorPlan(False, self._step, b.cap, None, torch.from_numpy(rows).to(device),
                              slot_mapping)
        cap = -(-(lk + 1) // CAP_STEP) * CAP_STEP
        if self._too_big == (len(seq_lens), cap):
            self._batch = None
            return None
        pos = np.arange(cap)
        cols = np.minimum(pos // block_size, tables.shape[1] - 1)
        slots = tables[:, cols].astype(np.int64) * block_size + pos % block_size
        slots = np.where(pos < seq_lens[:, None], slots, 0)  # past the end: null block
        self._batch = _Batch(tables, seq_lens, cap)
        self.rebuilds += 1
        return MirrorPlan(True, self._step, cap,
                          torch.from_numpy(np.ascontiguousarray(slots)).to(device), None, None)

    def kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: MirrorPlan,
           length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This layer's keys and values as [B, KVH, length, D] views, or None when the
        mirror would outgrow its budget (the caller gathers instead)."""
        b = self._batch
        if b is None:
            return None
        num_blocks, bs, kvh, d = k_cache.shape
        k_flat = k_cache.view(num_blocks * bs, kvh, d)
        v_flat = v_cache.view(num_blocks * bs, kvh, d)
        key = k_cache.data_ptr()
        if plan.rebuild:
            size = 2 * plan.key_slots.numel() * kvh * d * k_cache.element_size()
            cache_bytes = 2 * k_cache.numel() * k_cache.element_size()
            if size > cache_bytes or b.nbytes + size > MAX_MIRROR_BYTES:
                self._too_big = (plan.key_slots.shape[0], plan.cap)
                self._batch = None
                return None
            idx = plan.key_slots.view(-1)
            layer = _Layer(k_flat.index_select(0, idx), v_flat.index_select(0, idx), plan.step)
            b.layers[key] = layer
            b.nbytes += size
        else:
            layer = b.layers.get(key)
            if layer is None or layer.step != plan.step - 1:  # missed a step: not trusted
                b.layers.pop(key, None)
                return None
            layer.k.index_copy_(0, plan.new_rows, k_flat.index_select(0, plan.new_slots))
            layer.v.index_copy_(0, plan.new_rows, v_flat.index_select(0, plan.new_slots))
            layer.step = plan.step
        batch = layer.k.shape[0] // plan.cap
        k = layer.k.view(batch, plan.cap, kvh, d)[:, :length].transpose(1, 2)
        v = layer.v.view(batch, plan.cap, kvh, d)[:, :length].transpose(1, 2)
        return k, v


def _same_blocks(old: np.ndarray, new: np.ndarray, old_lens: np.ndarray, block_size: int
                 ) -> bool:
    """Every sequence still holds the blocks its previous keys were read from (a block
    added at the end, where another row was padding, does not count as a change)."""
    width = old.shape[1]
    used = np.arange(width) < (-(-old_lens // block_size))[:, None]  # [B, width]
    return bool(((new[:, :width] == old) | ~used).all())
