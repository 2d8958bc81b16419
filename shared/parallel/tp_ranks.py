"""A tensor-parallel engine's processes and their process groups.

Data-parallel rank d of D, at tensor-parallel size T, is T processes: the engine (its TP
rank 0: the service, the scheduler) and T - 1 workers it starts (``tp_worker``). When
the DP ranks share experts (D > 1 with expert parallelism) all D·T processes form one
world, global rank d·T + t, around rank 0's store at ``--data-parallel-address:
--data-parallel-rpc-port``; otherwise each DP rank's T ranks meet alone, on a loopback
port. The world is split into groups every process creates in the same order:

    tp[d]       ranks d·T .. d·T + T - 1: the layers' all-reduces (the device's backend)
    tp_cpu[d]   the same ranks over gloo: the step inputs rank 0 broadcasts (host objects)
    dp          ranks 0, T, 2T, ..: the engines, over gloo: lockstep flags, DyntraLB
    world       everything: expert parallelism (each rank its slots), EPLB's moves

Start-up: the workers load their shards while rank 0 loads its own, each says READY
(with what it holds) on a queue, and only then do the ranks join: a worker that fails
first ends rank 0's start-up with its error, never a collective's timeout.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from pdmesh.shared.infra.timeouts import collective_timeout_s
from pdmesh.shared.parallel.expert_parallel import dist_backend

log = logging.getLogger(__name__)

STOP = "stop"
READY, FAILED = "ready", "failed"


@dataclass(frozen=True)
class Topology:
    """Where one DP rank's tensor-parallel ranks sit in the world."""

    dp_rank: int
    dp_size: int
    tp_size: int
    address: str  # host:port of global rank 0's store
    backend: str  # the device's: gloo, nccl, hccl

    @property
    def world(self) -> int:
        return self.dp_size * self.tp_size

    def global_rank(self, tp_rank: int) -> int:
        return self.dp_rank * self.tp_size + tp_rank

    @property
    def src(self) -> int:
        """The global rank of this DP rank's engine (its TP rank 0)."""
        return self.global_rank(0)


@dataclass
class Groups:
    tp: Any  # None: the default group (the TP ranks are the world)
    tp_cpu: Any
    dp: Any
    src: int


def topology(config, tp_size: int, shares_experts: bool) -> Topology:
    """The topology an EngineConfig describes: the instance's world when its DP ranks
    share experts; otherwise each DP rank's TP ranks alone, on a free loopback port."""
    backend = dist_backend(config.device if config.device != "auto" else "cpu")
    if config.data_parallel_size > 1 and shares_experts:  # one world
        return Topology(config.data_parallel_rank, config.data_parallel_size, tp_size,
                        config.data_parallel_address, backend)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return Topology(0, 1, tp_size, f"127.0.0.1:{port}", backend)


def join(top: Topology, tp_rank: int) -> Groups:
    """Join the world and create every group (all processes, in the same order)."""
    host, _, port = top.address.rpartition(":")
    dist.init_process_group(top.backend, init_method=f"tcp://{host}:{port}",
                            rank=top.global_rank(tp_rank), world_size=top.world,
                            timeout=timedelta(seconds=collective_timeout_s()))
    cpu = top.backend == "gloo"
    tp = tp_cpu = None
    for d in range(top.dp_size):
        ranks = list(range(d * top.tp_size, (d + 1) * top.tp_size))
        g = dist.new_group(ranks) if top.dp_size > 1 else None
        g_cpu = g if cpu else dist.new_group(ranks, backend="gloo")
        if d == top.dp_rank:
            tp, tp_cpu = g, g_cpu
    dp = dist.new_group([d * top.tp_size for d in range(top.dp_size)], backend="gloo")
    return Groups(tp, tp_cpu, dp, top.src)


def receive(groups: Groups):
    box = [None]
    dist.broadcast_object_list(box, src=groups.src, group=groups.tp_cpu)
    return box[0]


class TensorParallelRanks:
    """Rank 0's side: starts the workers, waits until each has loaded its shard, joins
    the groups, hands each step's inputs on, stops them. A worker that fails, at start-up
    or later, ends what rank 0 is doing with that worker's own error."""

    def __init__(self, config, size: int, target, shares_experts: bool = False):
        """``target(config, rank, topology, messages)``: a worker process's main; it
        puts (READY, rank, what it holds) once its shard is loaded, (FAILED, rank,
        error) when it fails. ``shares_experts``: the DP ranks place a MoE model's
        experts over all their ranks (one world)."""
        self.topology = topology(config, size, shares_experts)
        self.address = self.topology.address
        self.size = size
        self.groups: Groups | None = None
        ctx = mp.get_context("spawn")
        self.messages = ctx.Queue()
        self.workers = [ctx.Process(target=target, args=(config, r, self.topology,
                                                          self.messages),
                                    daemon=True, name=f"pdmesh-tp{r}")
                        for r in range(1, size)]
        for w in self.workers:
            w.start()
        self.joined = False
        self.closed = False
        self.clock: dict[str, float] | None = None  # (TensorParallel.clock's)

    def join(self, timeout_s: float) -> list[dict]:
        """Wait for every worker's shard (they load while rank 0 loads its own), then
        join the groups. Returns what each worker reported (rank 1 first). RuntimeError
        with a worker's error as soon as one fails or exits; TimeoutError past
        ``timeout_s``. The workers are stopped either way on failure."""
        ready: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(ready) < self.size - 1:
                try:
                    kind, rank, info = self.messages.get(timeout=0.1)
                except queue.Empty:
                    self._exited()
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(1, self.size)) - set(ready))
                        raise TimeoutError(f"tensor-parallel ranks {missing} not ready after "
                                           f"{timeout_s:.0f} s (PDMESH_READY_TIMEOUT_S)"
                                           ) from None
                    continue
                if kind == FAILED:
                    raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {info}")
                ready[rank] = info
            self.groups = join(self.topology, 0)
        except BaseException:
            self.kill()
            raise
        self.joined = True
        return [ready[r] for r in sorted(ready)]

    def check(self) -> None:
        """RuntimeError naming a worker that has failed (its error when it sent one) or
        exited; nothing while all of them run."""
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
        assert self.groups is not None
        if payload != STOP:
            self.check()
        box = [payload]
        t0 = time.perf_counter()
        dist.broadcast_object_list(box, src=self.groups.src, group=self.groups.tp_cpu)
        if self.clock is not None:
            self.clock["broadcast"] = self.clock.get("broadcast", 0.0) + time.perf_counter() - t0

    def agree(self, ok: bool) -> bool:
        """Rank 0's side of ``agree``."""
        assert self.groups is not None
        return agree(ok, self.groups)

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
            if dist.is_initialized():
                dist.destroy_process_group()


def agree(ok: bool, groups: Groups) -> bool:
    """Whether every rank of the group says ``ok`` (each rank calls it with its own)."""
    import torch

    flag = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=groups.tp_cpu)
    return bool(flag[0])


def serve_steps(worker, messages, rank: int, groups: Groups) -> None:
    """A worker rank's loop: what rank 0 sends (``worker.run``) until STOP; an error goes
    to rank 0's queue before it ends the process."""
    try:
        while True:
            step = receive(groups)
            if step == STOP:
                break
            worker.run(step)
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 (rank 0 reports it)
        report_failure(messages, rank, e)
        raise


def report_failure(messages, rank: int, e: BaseException) -> None:
    messages.put((FAILED, rank, f"{e!r}\n{traceback.format_exc()}"))
