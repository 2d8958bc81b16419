"""Tensor parallelism inside one engine: N rank processes share every layer (Llama /
Qwen / Qwen-MoE / DeepSeek-V3; the processes and their groups: ``tp_ranks``).

Rank 0 is the engine (scheduler, KV manager, sampler, the service); ranks 1..N-1 are
workers it starts, each with its shard of the weights and of the paged cache, stepping
when rank 0 broadcasts a step's inputs (the host arrays a step is built from: tokens,
positions, block tables, slots). Every rank runs the same forward on its shard:

    embedding       vocabulary-parallel: rank r holds rows [r V/N, (r+1) V/N); a token
                    outside them reads zeros; all-reduce
    attention       q / k / v column-parallel by heads (K / V heads replicated when N
                    exceeds them), o row-parallel: all-reduce
                    MLA: query heads split, W_UK / W_UV per head, the latent (kv_a) and
                    its cache replicated, o row-parallel: all-reduce
    MLP / experts   gate | up column-parallel, down row-parallel (every expert split
                    along its intermediate size, shared experts too): all-reduce
                    with expert parallelism the routed experts stay whole, placed over
                    every rank of every DP rank: each TP rank sends its share of the
                    step's tokens through them (``token_share``); the MLP's all-reduce
                    joins the shares and the shared experts' partial sums
    LM head         vocabulary-parallel: the logits all-gathered once, for sampling

so a layer costs two all-reduces (gloo on CPU, nccl / hccl on GPU / NPU). Each rank
reads its slices straight from the safetensors (``CheckpointReader`` with a ``Shard``;
the model's shape on a rank: ``models.config.local_config``): no rank holds the whole
checkpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size`` tensor-parallel ranks. ``experts``: the routed experts
    split along their width too (False: expert parallelism places them whole);
    ``shared``: the shared experts split too (False: enable_shared_expert_dp, each rank
    runs them whole on its share of the tokens)."""

    rank: int
    size: int
    experts: bool = True
    shared: bool = True

    def part(self, n: int, what: str) -> slice:
        """Rows [r n/N, (r+1) n/N) of ``n`` split evenly (ValueError naming ``what``)."""
        if n % self.size:
            raise ValueError(f"tensor_parallel_size: {self.size} does not divide {what} ({n})")
        k = n // self.size
        return slice(self.rank * k, (self.rank + 1) * k)

    def kv_heads(self, kv_heads: int) -> slice:
        """This rank's K / V heads: an even share, or, with more ranks than heads, the
        one head its query heads read (replicated over size / kv_heads ranks)."""
        if self.size <= kv_heads:
            return self.part(kv_heads, "num_key_value_heads")
        if self.size % kv_heads:
            raise ValueError(f"tensor_parallel_size: {self.size} must divide or be a "
                             f"multiple of num_key_value_heads ({kv_heads})")
        head = self.rank * kv_heads // self.size
        return slice(head, head + 1)

    def vocab(self, vocab: int) -> tuple[int, int]:
        """(first row, rows) of this rank's vocabulary shard: ceil(V / N) rows each,
        the last one short."""
        per = -(-vocab // self.size)
        start = min(self.rank * per, vocab)
        return start, min(per, vocab - start)


class TensorParallel:
    """The collectives a rank's forward makes, in its tensor-parallel group (``group``,
    set once the ranks have joined; None: the default group, the ranks alone)."""

    def __init__(self, shard: Shard, vocab_size: int):
        self.shard = shard
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_rows = shard.vocab(vocab_size)
        self.group = None
        # seconds spent in each kind of collective, when a benchmark asks (None: not kept)
        self.clock: dict[str, float] | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.clock is None:
            dist.all_reduce(x, group=self.group)
            return x
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.clock["all_reduce"] = self.clock.get("all_reduce", 0.0) + time.perf_counter() - t0
        return x

    def token_share(self, n: int) -> slice:
        """The rows of a step's ``n`` tokens this rank sends through expert parallelism
        (every rank holds them all; each sends its share, the MLP's all-reduce joins
        the results)."""
        per = -(-n // self.shard.size)
        return slice(min(n, self.shard.rank * per), min(n, (self.shard.rank + 1) * per))

    def moe_on_share(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                                       torch.Tensor],
                     shared: Callable[[torch.Tensor], torch.Tensor] | None = None
                     ) -> torch.Tensor:
        """A MoE whose experts this rank holds whole (EP's slots, an MTP block's under
        EP): ``experts(x, weights, ids)`` on this rank's share of the tokens, zeros on
        the others', for the all-reduce after the MLP to join; ``shared`` (the shared
        experts whole, enable_shared_expert_dp) on the share too."""
        rows = self.token_share(x.shape[0])
        out = torch.zeros_like(x)
        mine = x[rows]
        out[rows] = experts(mine, weights[rows], ids[rows])
        if shared is not None:
            out[rows] += shared(mine)
        return out

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the vocabulary-parallel embedding: each rank its own, summed."""
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_rows)
        h = table.index_select(0, local.clamp(0, max(self.vocab_rows - 1, 0)))
        h = h * mine.unsqueeze(-1).to(h.dtype)
        return self.all_reduce(h)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[B, V / N] on each rank -> [B, V] on every rank."""
        per = -(-self.vocab_size // self.shard.size)
        if local.shape[-1] < per:  # the last shard is short: pad to the common width
            local = torch.nn.functional.pad(local, (0, per - local.shape[-1]))
        parts = [torch.empty_like(local) for _ in range(self.shard.size)]
        t0 = time.perf_counter()
        dist.all_gather(parts, local.contiguous(), group=self.group)
        if self.clock is not None:
            self.clock["gather_logits"] = (self.clock.get("gather_logits", 0.0)
                                           + time.perf_counter() - t0)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]
