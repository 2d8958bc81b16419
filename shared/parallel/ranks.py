"""Run one function as the DP ranks of an instance (a benchmark's, a test's): spawned
processes on loopback, the results gathered by rank, any rank's failure raised with its
traceback."""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from collections.abc import Callable, Iterator
from typing import Any


def run_ranks(body: Callable[..., Any], world: int, *args: Any,
              timeout_s: float = 3600) -> dict[int, Any]:
    """``body(rank, world, address, *args)`` in ``world`` spawned processes (``address``:
    a free loopback port for the process group; ``args`` must pickle; a ``Barrier`` of
    ``world`` parties may be made with ``barrier()``). Returns each rank's result."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    procs = [ctx.Process(target=_rank, args=(body, r, world, address, args, out))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in procs:
            rank, result, err = out.get(timeout=timeout_s)
            if err:
                raise RuntimeError(f"rank {rank} failed:\n{err}")
            got[rank] = result
        return got
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def barrier(world: int):
    """A barrier the ranks of ``run_ranks`` can share (pass it in ``args``)."""
    return mp.get_context("spawn").Barrier(world)


def lockstep(engine: Any, group: Any = None) -> Iterator[int]:
    """The step numbers of a DP instance's lockstep: while any rank of ``group`` (the
    default group: all) has work, each rank steps, an idle one too (its MoE layers take
    part in the others' all-to-alls). The caller steps the engine in the loop body."""
    import torch
    import torch.distributed as dist

    flag = torch.zeros(1, dtype=torch.int64)
    step = 0
    while True:
        flag[0] = int(engine.has_unfinished())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not flag[0]:
            return
        yield step
        step += 1


def _rank(body: Callable[..., Any], rank: int, world: int, address: str,
          args: tuple[Any, ...], out: mp.Queue) -> None:
    try:
        out.put((rank, body(rank, world, address, *args), None))
    except Exception:  # noqa: BLE001 (reported to the parent)
        out.put((rank, None, traceback.format_exc()))
