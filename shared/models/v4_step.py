"""DeepSeek-V4's step plan: what every layer of one step shares, built once on the host
from the step's attention metadata - the window-group slot each new token is written to,
each sequence's window keys and what each query sees of them, and per (compression rate,
overlap) the windows that close this step, where their entries go and which entries
each query sees. ``DeepseekV4`` builds it before its first layer (and decode graphs
before their first piece: ``graph_state``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdmesh.shared.kernels import AttentionMetadata
from pdmesh.shared.models.config import CSA, V4Config


@dataclass
class Compression:
    """One step's work for the compressed layers of one (rate, overlap)."""

    closing_slots: torch.Tensor  # [NW, rows] window-group slots of each closing window
    closing_valid: torch.Tensor  # [NW, rows] bool (CSA's window -1 does not exist)
    closing_dest: torch.Tensor  # [NW] compressed-group entry slot
    closing_pos: torch.Tensor  # [NW] the window's first position (its entry's rotation)
    entry_slots: torch.Tensor  # [S, E] each sequence's entries (0: padding, masked)
    causal: torch.Tensor  # [S, Lq, E] bool: entry e's window is over for the query


@dataclass
class Step:
    """What every layer of one step shares, built once on the host."""

    num_seqs: int
    max_query: int
    decode: bool
    q_valid: torch.Tensor | None  # [S, Lq] bool (None: one sequence, or decode)
    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T] window-group slot of each new token
    window_slots: torch.Tensor  # [S, Lw] the window keys of each sequence
    window_visible: torch.Tensor  # [S, Lq, Lw] bool
    compression: dict[tuple[int, bool], Compression]


def step_plan(v4: V4Config, meta: AttentionMetadata, positions: torch.Tensor,
          dev: torch.device, compressed: bool = True) -> Step:
    """``compressed`` False: the window alone (an MTP block's sliding layer), no
    compression plans."""
    if not len(meta.query_lens_host):  # a lockstep rank's idle forward: none attends
        none = torch.zeros((0, 0), dtype=torch.int64, device=dev)
        return Step(0, 0, True, None, positions, none.view(0), none,
                     none.view(0, 0, 0).bool(), {})
    bs = meta.block_size
    qlens = np.asarray(meta.query_lens_host, dtype=np.int64)
    starts = np.asarray(meta.context_lens_host, dtype=np.int64)
    ends = np.asarray(meta.seq_lens_host, dtype=np.int64)
    s, lq = len(qlens), int(qlens.max())
    ctable = np.asarray(meta.block_tables_host, dtype=np.int64)  # compressed group
    wtable = np.asarray(meta.group_tables_host[0], dtype=np.int64)  # window group
    seq_of = np.repeat(np.arange(s), qlens)
    pos = (np.asarray(meta.positions_host, dtype=np.int64) if meta.positions_host
           is not None else meta_positions(starts, qlens))
    write = wtable[seq_of, pos // bs] * bs + pos % bs

    def window_slot(seq: np.ndarray, p: np.ndarray, ok: np.ndarray) -> np.ndarray:
        safe = np.where(ok, p, 0)
        return np.where(ok, wtable[seq, safe // bs] * bs + safe % bs, 0)

    q_pos = starts[:, None] + np.arange(lq)  # [S, Lq]
    lo = np.maximum(0, starts - v4.window + 1)
    lw = int((ends - lo).max())
    key_pos = lo[:, None] + np.arange(lw)  # [S, Lw]
    key_ok = key_pos < ends[:, None]
    rows = np.broadcast_to(np.arange(s)[:, None], key_pos.shape)
    window_slots = window_slot(rows, key_pos, key_ok)
    ahead = q_pos[:, :, None] - key_pos[:, None, :]  # [S, Lq, Lw]
    visible = key_ok[:, None, :] & (ahead >= 0) & (ahead < v4.window)

    comp: dict[tuple[int, bool], Compression] = {}
    for kind, rate in zip(v4.layer_types, v4.compress_rates, strict=True):
        key = (rate, kind == CSA)
        if not compressed or not rate or key in comp:
            continue
        overlap = kind == CSA
        spb = max(1, bs // rate)
        # windows that close in this step: w with (w + 1) * rate - 1 in [start, end)
        counts = ends // rate - starts // rate
        seq_w = np.repeat(np.arange(s), counts)
        w = (np.repeat(starts // rate, counts)
             + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts))
        span = 2 * rate if overlap else rate
        first = (w - 1) * rate if overlap else w * rate
        rows_pos = first[:, None] + np.arange(span)  # [NW, span]
        rows_ok = rows_pos >= 0
        closing = window_slot(np.broadcast_to(seq_w[:, None], rows_pos.shape), rows_pos,
                              rows_ok)
        dest = ctable[seq_w, ((w + 1) * rate - 1) // bs] * spb + w % spb
        num_entries = ends // rate
        e_max = int(num_entries.max())
        e = np.arange(e_max)
        e_ok = e[None, :] < num_entries[:, None]
        entry_slots = np.where(
            e_ok, ctable[np.arange(s)[:, None],
                         np.where(e_ok, ((e + 1) * rate - 1) // bs, 0)] * spb + e % spb, 0)
        causal = e[None, None, :] < ((q_pos + 1) // rate)[:, :, None]  # [S, Lq, E]
        comp[key] = Compression(
            _t(closing, dev), _t(rows_ok, dev), _t(dest, dev), _t(w * rate, dev),
            _t(entry_slots, dev), _t(causal, dev))
    q_valid = None
    if s > 1 and lq > 1:
        q_valid = _t(np.arange(lq)[None, :] < qlens[:, None], dev)
    return Step(s, lq, lq == 1, q_valid, positions, _t(write, dev), _t(window_slots, dev),
                 _t(visible, dev), comp)


def _t(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def meta_positions(starts: np.ndarray, qlens: np.ndarray) -> np.ndarray:
    offsets = np.arange(int(qlens.sum())) - np.repeat(np.cumsum(qlens) - qlens, qlens)
    return np.repeat(starts, qlens) + offsets
