"""Fine-grained tensor parallelism (vLLM-Ascend's ``finegrained_tp_config``): single
modules split over groups of data-parallel ranks, the rest of the model whole on each.

With ``--data-parallel-size D`` (and tensor_parallel_size 1), a module of size k > 1 is
split over each run of k consecutive DP ranks (k divides D); rank r of D is rank r % k of
its group. Each DP rank keeps its own requests; a split module gathers the group's rows,
computes its slice for all of them and hands every rank back its own:

    embedding   vocabulary rows split: the group's token ids all-gathered, each rank
                embeds those in its rows (zeros elsewhere), reduce-scatter: own rows
    o_proj      input (head) columns split: each rank's attention outputs sent head-slice
                by head-slice (all-to-all), each rank multiplies its slice for the whole
                group, reduce-scatter: own rows
    mlp         dense layers only (a MoE model's dense layers; never its experts): gate /
                up columns and down rows split; rows all-gathered, reduce-scatter back
    lm_head     vocabulary columns split: the rows to sample all-gathered, each rank's
                logits slice sent back to the rows' owners (all-to-all), joined

Rows differ between ranks: each forward starts by all-gathering every rank's token and
sample-row counts (``begin``), and pads to the group's largest. The ranks therefore step
in lockstep (an idle rank runs a forward of no tokens), as expert-parallel ranks do.

Decode graphs (pdmesh.shared.engine.decode_graphs) capture the split modules' collectives
inside their pieces, so every rank replays the same capture size at the same step: the
ranks agree on it first (``agree_step``: graphs only if every rank can, the largest size
any needs) and the forward runs with every rank's counts that size (``same_rows``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdmesh.shared.parallel.tensor_parallel import Shard

MODULES = ("embedding", "lmhead", "oproj", "mlp")
KEYS = {m: f"{m}_tensor_parallel_size" for m in MODULES}


@dataclass(frozen=True)
class FineGrainedLayout:
    """Which modules are split, over how many DP ranks, and this rank's place."""

    sizes: tuple[tuple[str, int], ...]  # (module, k > 1), for the split modules only
    dp_rank: int
    dp_size: int

    @classmethod
    def from_config(cls, config: dict[str, int] | None, dp_rank: int, dp_size: int
                    ) -> FineGrainedLayout | None:
        """``config``: finegrained_tp_config's keys (``*_tensor_parallel_size``; 0 or 1:
        not split). ValueError naming the key for a size that does not divide D."""
        sizes = []
        for m in MODULES:
            k = int((config or {}).get(KEYS[m], 0) or 0)
            if k < 0:
                raise ValueError(f"finegrained_tp_config.{KEYS[m]}: must be >= 0, got {k}")
            if k > 1:
                if dp_size % k:
                    raise ValueError(f"finegrained_tp_config.{KEYS[m]}: {k} must divide "
                                     f"data_parallel_size ({dp_size})")
                sizes.append((m, k))
        return cls(tuple(sizes), dp_rank, dp_size) if sizes else None

    def size(self, module: str) -> int:
        return dict(self.sizes).get(module, 1)

    def shard(self, module: str) -> Shard | None:
        """This rank's slice of ``module`` (None: the module is whole here)."""
        k = self.size(module)
        return Shard(self.dp_rank % k, k) if k > 1 else None


class FineGrainedTP:
    """The split modules' collectives for one DP rank's forward (its groups joined)."""

    def __init__(self, layout: FineGrainedLayout, vocab_size: int):
        """Creates every group of every split size (each DP rank, in the same order)."""
        self.layout = layout
        self.vocab_size = vocab_size
        self.groups: dict[int, object] = {}
        for k in sorted({k for _, k in layout.sizes}):
            for start in range(0, layout.dp_size, k):
                g = dist.new_group(list(range(start, start + k)))
                if start <= layout.dp_rank < start + k:
                    self.groups[k] = g
        self.counts: dict[int, list[tuple[int, int]]] = {}
        self.gloo = dist.get_backend() == "gloo"
        self._same: int | None = None  # inside ``same_rows``: every rank's count

    def begin(self, tokens: int, rows: int, device: torch.device | str = "cpu") -> None:
        """Every group's token and sample-row counts for this forward (exchanged on
        ``device``, the model's: NCCL and HCCL move device tensors only)."""
        if self._same is not None:
            if (tokens, rows) != (self._same, self._same):
                raise ValueError(f"fine-grained TP: a forward of {tokens} tokens and {rows} "
                                 f"rows inside same_rows({self._same})")
            return
        for k, g in self.groups.items():
            mine = torch.tensor([tokens, rows], dtype=torch.int64, device=device)
            parts = [torch.empty_like(mine) for _ in range(k)]
            dist.all_gather(parts, mine, group=g)
            self.counts[k] = [(int(p[0]), int(p[1])) for p in parts]

    @contextmanager
    def same_rows(self, rows: int) -> Iterator[None]:
        """Forwards in which every rank has ``rows`` tokens, each sampled (a decode
        graph's capture size): no exchange of counts, whose host read a capture refuses."""
        saved = self.counts
        self.counts = {k: [(rows, rows)] * k for k in self.groups}
        self._same = rows
        try:
            yield
        finally:
            self.counts, self._same = saved, None

    def agree_step(self, wish: int | None, per_seq: int, device: torch.device | str
                   ) -> int | None:
        """The capture size every rank replays this step (each rank's ``wish``: the size
        its step pads to, 0 for an idle rank, None for a step it runs eagerly; ``per_seq``:
        its tokens per sequence, 0 idle), or None: every rank runs eagerly. One
        all-reduce over the DP ranks, made by every rank at every forward."""
        refused = wish is None or per_seq > 1  # (fine-grained TP: no drafts to verify)
        mine = torch.tensor([int(refused), wish or 0], dtype=torch.int64, device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        refused_any, size = (int(v) for v in mine.tolist())
        return None if refused_any or size == 0 else size

    def agree(self, ok: bool, device: torch.device | str) -> bool:
        """Whether every DP rank says ``ok`` (a capture kept by all or by none)."""
        mine = torch.tensor([int(ok)], dtype=torch.int64, device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MIN)
        return bool(mine.item())

    # -- the group's rows ---------------------------------------------------------------
    def _gather(self, x: torch.Tensor, k: int, most: int) -> torch.Tensor:
        """[n, ...] on each rank -> [k * most, ...]: every rank's rows, padded to ``most``."""
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, most - x.shape[0]))
        parts = [torch.empty_like(x) for _ in range(k)]
        dist.all_gather(parts, x.contiguous(), group=self.groups[k])
        return torch.cat(parts)

    def _reduce_scatter(self, y: torch.Tensor, k: int, most: int, n: int) -> torch.Tensor:
        """[k * most, H] partial sums -> this rank's ``n`` rows of the sum."""
        r = self.layout.dp_rank % k
        if self.gloo:  # (gloo has no reduce-scatter)
            dist.all_reduce(y, group=self.groups[k])
            return y[r * most:r * most + n]
        out = y.new_empty((most, *y.shape[1:]))
        dist.reduce_scatter_tensor(out, y.contiguous(), group=self.groups[k])
        return out[:n]

    def _most(self, k: int, which: int) -> int:
        return max(c[which] for c in self.counts[k])

    # -- the modules --------------------------------------------------------------------
    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """table: this rank's vocabulary rows; ids [T] -> [T, H]."""
        shard = self.layout.shard("embedding")
        assert shard is not None
        k, most = shard.size, self._most(shard.size, 0)
        every = self._gather(ids.unsqueeze(1), k, most).squeeze(1)
        start = shard.rank * -(-self.vocab_size // k)
        local = every - start
        mine = (local >= 0) & (local < table.shape[0])
        h = table.index_select(0, local.clamp(0, max(table.shape[0] - 1, 0)))
        h = h * mine.unsqueeze(-1).to(h.dtype)
        return self._reduce_scatter(h, k, most, ids.shape[0])

    def o_proj(self, o: torch.Tensor, w, backend) -> torch.Tensor:
        """o [T, W] (every head's output); w: this rank's W / k input rows."""
        shard = self.layout.shard("oproj")
        assert shard is not None
        k, most, n = shard.size, self._most(shard.size, 0), o.shape[0]
        width = o.shape[1] // k
        padded = torch.nn.functional.pad(o, (0, 0, 0, most - n))
        # block j: my rows' head-slice j, for rank j
        send = padded.view(most, k, width).transpose(0, 1).reshape(k * most, width)
        recv = torch.empty_like(send)  # block i: rank i's rows, my head-slice
        dist.all_to_all_single(recv, send.contiguous(), group=self.groups[k])
        return self._reduce_scatter(backend.linear(recv, w), k, most, n)

    def mlp(self, x: torch.Tensor, gate_up, down, backend) -> torch.Tensor:
        """A dense MLP whose gate / up columns and down rows are this rank's share."""
        shard = self.layout.shard("mlp")
        assert shard is not None
        k, most = shard.size, self._most(shard.size, 0)
        every = self._gather(x, k, most)
        y = backend.linear(backend.silu_and_mul(backend.linear(every, gate_up)), down)
        return self._reduce_scatter(y, k, most, x.shape[0])

    def lm_head(self, last: torch.Tensor, w, backend) -> torch.Tensor:
        """last [B, H] -> logits [B, V] float32; w: this rank's [H, V / k] columns."""
        shard = self.layout.shard("lmhead")
        assert shard is not None
        k, most, n = shard.size, self._most(shard.size, 1), last.shape[0]
        per = -(-self.vocab_size // k)
        logits = backend.linear(self._gather(last, k, most), w).float()  # [k * most, <=per]
        logits = torch.nn.functional.pad(logits, (0, per - logits.shape[1]))
        recv = torch.empty_like(logits)  # block j: my rows, rank j's vocabulary slice
        dist.all_to_all_single(recv, logits.contiguous(), group=self.groups[k])
        joined = recv.view(k, most, per).transpose(0, 1).reshape(most, k * per)
        return joined[:n, :self.vocab_size]

