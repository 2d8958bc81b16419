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
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # (the models import Shard from here)
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
READY, FAILED = "ready", "failed"


class TensorParallelRanks:
    """Rank 0's side: starts the workers, waits until each has loaded its shard, joins
    their group, hands each step's inputs on, stops them. A worker that fails, at start-up
    or later, ends what rank 0 is doing with that worker's own error."""

    def __init__(self, config, size: int, target):
        """``target(config, rank, size, address, messages)``: a worker process's main; it
        puts (READY, rank, what it holds) once its shard is loaded, (FAILED, rank,
        error) when it fails."""
        import multiprocessing as mp
        import socket

        with socket.socket() as s:  # the group's store, on loopback
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        self.size = size
        self.backend = _backend(config.device)
        ctx = mp.get_context("spawn")
        self.messages = ctx.Queue()
        self.workers = [ctx.Process(target=target, args=(config, r, size, self.address,
                                                          self.messages),
                                    daemon=True, name=f"pdmesh-tp{r}")
                        for r in range(1, size)]
        for w in self.workers:
            w.start()
        self.joined = False
        self.closed = False

    def join(self, timeout_s: float) -> list[dict]:
        """Wait for every worker's shard (they load while rank 0 loads its own), then
        join the group. Returns what each worker reported (rank 1 first). RuntimeError
        with a worker's error as soon as one fails or exits; TimeoutError past
        ``timeout_s``. The workers are stopped either way on failure."""
        import queue
        import time

        ready: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(ready) < self.size - 1:
                try:
                    kind, rank, info = self.messages.get(timeout=0.1)
                except queue.Empty:
                    self._exited()
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"tensor-parallel ranks {sorted(set(range(1, self.size)) - set(ready))}"
                            f" not ready after {timeout_s:.0f} s (PDMESH_READY_TIMEOUT_S)"
                        ) from None
                    continue
                if kind == FAILED:
                    raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {info}")
                ready[rank] = info
            init(0, self.size, self.address, self.backend)
        except BaseException:
            self.kill()
            raise
        self.joined = True
        return [ready[r] for r in sorted(ready)]

    def check(self) -> None:
        """RuntimeError naming a worker that has failed (its error when it sent one) or
        exited; nothing while all of them run."""
        import queue

        try:
            kind, rank, info = self.messages.get_nowait()
        except queue.Empty:
            pass
        else:
            if kind == FAILED:
                raise RuntimeError(f"tensor-parallel rank {rank} failed: {info}")
        self._exited()

    def _exited(self) -> None:
        for r, w in enumerate(self.workers, start=1):
            if w.exitcode is not None:
                why = self._failure(r)
                raise RuntimeError(f"tensor-parallel rank {r} exited (code {w.exitcode})"
                                   + (f": {why}" if why else ""))

    def _failure(self, rank: int) -> str | None:
        """The error a worker that exited sent, if it sent one (it may still be in the
        queue's pipe)."""
        import queue

        while True:
            try:
                kind, r, info = self.messages.get(timeout=1.0)
            except queue.Empty:
                return None
            if kind == FAILED and r == rank:
                return info

    def broadcast(self, payload) -> None:
        """Rank 0: what every rank needs to run the step (or STOP); a worker that has
        failed since the last step is reported here rather than as a collective's
        timeout."""
        if payload != STOP:
            self.check()
        box = [payload]
        dist.broadcast_object_list(box, src=0)

    def kill(self) -> None:
        self.closed = True
        for w in self.workers:
            if w.is_alive():
                w.kill()
            w.join(timeout=5)

    def close(self) -> None:
        if self.closed:
            return
        if not self.joined:
            self.kill()
            return
        self.closed = True
        try:
            if all(w.is_alive() for w in self.workers):
                self.broadcast(STOP)
        finally:
            for w in self.workers:
                w.join(timeout=30)
                if w.is_alive():
                    w.kill()
            dist.destroy_process_group()


def _backend(device: str) -> str:
    from pdmesh.shared.parallel.expert_parallel import dist_backend

    return dist_backend(device if device != "auto" else "cpu")


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


def serve_steps(worker, messages, rank: int) -> None:
    """A worker rank's loop: what rank 0 sends (``worker.run``) until STOP; an error goes
    to rank 0's queue before it ends the process."""
    try:
        while True:
            step = receive()
            if step == STOP:
                break
            worker.run(step)
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 (rank 0 reports it)
        report_failure(messages, rank, e)
        raise


def report_failure(messages, rank: int, e: BaseException) -> None:
    import traceback

    messages.put((FAILED, rank, f"{e!r}\n{traceback.format_exc()}"))
