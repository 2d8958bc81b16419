"""Tensor parallelism inside one engine: N rank processes share every layer (issue 19,
first part: Llama / Qwen / Qwen-MoE / DeepSeek-V3, one engine, no DP / EP / speculation
beside it yet).

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
    LM head         vocabulary-parallel: the logits all-gathered once, for sampling

so a layer costs two all-reduces (gloo on CPU, nccl / hccl on GPU / NPU). Each rank
reads its slices straight from the safetensors (``CheckpointReader`` with a ``Shard``):
no rank holds the whole checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdmesh.shared.models.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size`` tensor-parallel ranks."""

    rank: int
    size: int

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


def local_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The model as one rank computes it: its query heads, K / V heads and MLP and
    expert widths (everything else, the vocabulary included, as it is)."""
    if cfg.v4 is not None:
        raise ValueError("tensor_parallel_size: DeepSeek-V4 does not run tensor-parallel "
                         "yet (its grouped output projection and hyper-connections)")
    heads = cfg.num_heads // shard.size
    shard.part(cfg.num_heads, "num_attention_heads")
    kv = shard.kv_heads(cfg.num_kv_heads)
    changes: dict = {"num_heads": heads, "num_kv_heads": kv.stop - kv.start}
    if cfg.intermediate_size:
        shard.part(cfg.intermediate_size, "intermediate_size")
        changes["intermediate_size"] = cfg.intermediate_size // shard.size
    if cfg.moe is not None:
        shard.part(cfg.moe.intermediate_size, "moe_intermediate_size")
        changes["moe"] = dataclasses.replace(
            cfg.moe, intermediate_size=cfg.moe.intermediate_size // shard.size)
    return dataclasses.replace(cfg, **changes)


class TensorParallel:
    """The collectives a rank's forward makes (the default process group: the
    instance's tensor-parallel ranks)."""

    def __init__(self, shard: Shard, vocab_size: int):
        self.shard = shard
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_rows = shard.vocab(vocab_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

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
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]


# -- the ranks ------------------------------------------------------------------------------
STOP = "stop"


class TensorParallelRanks:
    """Rank 0's side: starts the workers, joins the group, hands each step's inputs on,
    stops them."""

    def __init__(self, config, size: int, target):
        """``target(config, rank, size, address, errors)``: a worker process's main."""
        import multiprocessing as mp
        import socket

        from pdmesh.shared.parallel.expert_parallel import dist_backend

        with socket.socket() as s:  # the group's store, on loopback
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        self.size = size
        ctx = mp.get_context("spawn")
        self.errors = ctx.Queue()
        self.workers = [ctx.Process(target=target, args=(config, r, size, self.address,
                                                          self.errors),
                                    daemon=True, name=f"pdmesh-tp{r}")
                        for r in range(1, size)]
        for w in self.workers:
            w.start()
        init(0, size, self.address, dist_backend(config.device if config.device != "auto"
                                                 else "cpu"))
        self.closed = False

    def broadcast(self, payload) -> None:
        """Rank 0: what every rank needs to run the step (or STOP)."""
        box = [payload]
        dist.broadcast_object_list(box, src=0)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.broadcast(STOP)
        finally:
            for w in self.workers:
                w.join(timeout=30)
                if w.is_alive():
                    w.kill()
            dist.destroy_process_group()


def init(rank: int, size: int, address: str, backend: str) -> None:
    from datetime import timedelta

    from pdmesh.shared.parallel.expert_parallel import COLLECTIVE_TIMEOUT_S

    host, _, port = address.rpartition(":")
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def receive():
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def serve_steps(worker, errors, rank: int) -> None:
    """A worker rank's loop: the steps rank 0 sends (``worker.run_step``) until STOP;
    an error goes to rank 0's queue before it ends the process."""
    try:
        while True:
            step = receive()
            if step == STOP:
                break
            worker.run_step(step)
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 (rank 0 reports it)
        import traceback

        errors.put((rank, f"{e!r}\n{traceback.format_exc()}"))
        raise
