"""`pdmesh bench dyntralb`: what the DP bubble costs lockstep decode ranks, and what
DyntraLB wins back.

Two expert-parallel DP ranks (gloo on loopback, each the real ``EngineLoop`` as a
`--data-parallel-size 2 --enable-expert-parallel` decode instance runs it) serve the
same long-tailed workload in two passes, one run: DyntraLB off, and on (vLLM-Ascend's
planner, static mode from ``--start-step``). Every request gets a short random prompt; output
lengths follow a Pareto tail, and rank 0 collects the long ones (``--skew`` times the
others' mean), so its KV grows while the other rank's stays small: the bubble.

Per pass: output throughput (all ranks' tokens / wall time), TPOT p50 / p99 over the
requests, lockstep step time p50 / p99, and the mean bubble (max - mean running KV
blocks over the ranks, per step).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from typing import Any

from pdmesh.shared.parallel.ranks import barrier, run_ranks

PASSES = ("off", "vllm_ascend")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a MoE model (make-tiny-model --arch "
                                                  "qwen3_moe)")
    p.add_argument("--num-prompts", type=int, default=48, help="per rank")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=48, help="mean output length")
    p.add_argument("--skew", type=float, default=4.0,
                   help="rank 0's mean output length over the others'")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--bubble-threshold", type=float, default=5.0)
    p.add_argument("--start-step", type=int, default=1)
    p.add_argument("--passes", default=",".join(PASSES))
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--record-loads", default=None, metavar="PATH",
                   help="append every plan's rank loads and moves (JSON lines) here")


def run(a: argparse.Namespace) -> int:
    passes = [x for x in a.passes.split(",") if x]
    unknown = sorted(set(passes) - set(PASSES))
    if unknown:
        raise ValueError(f"--passes: unknown {', '.join(unknown)} (choose from "
                         f"{', '.join(PASSES)})")
    results = {name: _pass(a, name) for name in passes}
    for name, r in results.items():
        print(f"{name:12s} {r['tok_s']:8.1f} tok/s | TPOT p50 {r['tpot_ms_p50']:6.2f} p99 "
              f"{r['tpot_ms_p99']:6.2f} ms | step p50 {r['step_ms_p50']:6.2f} p99 "
              f"{r['step_ms_p99']:6.2f} ms | bubble {r['bubble_mean']:6.1f} blocks | "
              f"pauses {r['pauses']}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def workload(a: argparse.Namespace, rank: int, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt, output length) per request of ``rank``: Pareto-tailed lengths, rank 0's
    ``skew`` times longer on average."""
    rng = random.Random(a.seed * 1000 + rank)
    mean = a.output_len * (a.skew if rank == 0 else 1.0)
    alpha = 2.0  # Pareto mean = alpha / (alpha - 1) * scale
    out = []
    for _ in range(a.num_prompts):
        n = max(1, int(rng.paretovariate(alpha) * mean / 2))
        prompt = [rng.randrange(10, vocab - 10) for _ in range(a.input_len)]
        out.append((prompt, n))
    return out


def _pass(a: argparse.Namespace, planner: str) -> dict[str, Any]:
    opts = {k: v for k, v in vars(a).items() if k != "func"}
    got = run_ranks(_rank_body, 2, opts, planner, barrier(2))
    if a.record_loads and got[0]["plans"]:
        with open(a.record_loads, "a") as f:
            f.writelines(json.dumps(plan) + "\n" for plan in got[0]["plans"])
    tpots = sorted(got[0]["tpots"] + got[1]["tpots"])
    steps = sorted(got[0]["steps"])
    n = min(len(got[0]["blocks"]), len(got[1]["blocks"]))
    bubbles = [max(b) - sum(b) / 2 for b in zip(got[0]["blocks"][:n], got[1]["blocks"][:n],
                                                 strict=True)]
    wall = max(got[0]["wall"], got[1]["wall"])
    return {"tok_s": (got[0]["tokens"] + got[1]["tokens"]) / wall,
            "tpot_ms_p50": 1000 * _pct(tpots, 0.5), "tpot_ms_p99": 1000 * _pct(tpots, 0.99),
            "step_ms_p50": 1000 * _pct(steps, 0.5), "step_ms_p99": 1000 * _pct(steps, 0.99),
            "bubble_mean": statistics.fmean(bubbles) if bubbles else 0.0,
            "pauses": got[0]["pauses"] + got[1]["pauses"], "wall_s": wall}


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _rank_body(rank: int, world: int, address: str, opts: dict[str, Any], planner: str,
               everyone) -> dict[str, Any]:
    import torch

    from pdmesh.shared.config.scheduler_schema import DyntraLBConfig
    from pdmesh.shared.engine.build import build_engine
    from pdmesh.shared.engine.config import EngineConfig
    from pdmesh.shared.engine.sampling_params import SamplingParams
    from pdmesh.shared.runtime.loop import EngineLoop, LocalPort
    from pdmesh.shared.runtime.protocol import SubmitRequest

    a = argparse.Namespace(**opts)
    torch.set_num_threads(a.threads)
    lb = None if planner == "off" else DyntraLBConfig(
        enabled=True, mode="static", start_step=a.start_step,
        bubble_threshold=a.bubble_threshold)
    eng = build_engine(EngineConfig(
        model=a.model, device="cpu", dtype="float32", block_size=a.block_size,
        max_num_seqs=a.max_num_seqs, data_parallel_size=world, data_parallel_rank=rank,
        data_parallel_address=address, enable_expert_parallel=True, dyntra_lb=lb))
    requests = workload(a, rank, eng.model_config.vocab_size)
    if eng.dyntralb is not None and rank == 0 and a.record_loads:
        eng.dyntralb.record = []
    port = LocalPort()
    loop = EngineLoop(eng, port)
    times: dict[str, list[float]] = {}
    done = threading.Event()
    finished = 0

    def on_deltas(deltas) -> None:
        nonlocal finished
        now = time.perf_counter()
        for d in deltas:
            times.setdefault(d.request_id, []).extend([now] * len(d.token_ids))
            if d.finish_reason is not None:
                finished += 1
                if finished == len(requests):
                    done.set()

    port.on_deltas = on_deltas
    steps: list[float] = []
    blocks: list[int] = []
    step = eng.step
    bs = a.block_size

    def timed_step():
        blocks.append(sum(-(-r.num_tokens // bs) for r in eng.scheduler.running))
        t0 = time.perf_counter()
        try:
            return step()
        finally:
            steps.append(time.perf_counter() - t0)

    eng.step = timed_step

    def feed_and_wait() -> None:
        for i, (prompt, n) in enumerate(requests):
            port.put(SubmitRequest(f"r{rank}-{i}", prompt, SamplingParams(
                temperature=0, max_tokens=n, ignore_eos=True), 0, []))
        done.wait(3600)
        everyone.wait(3600)  # every rank done: now all may stop together
        loop.stop()

    t0 = time.perf_counter()
    feeder = threading.Thread(target=feed_and_wait)
    feeder.start()
    loop.run()
    wall = time.perf_counter() - t0
    feeder.join()
    tpots = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times.values() if len(ts) > 1]
    return {"tokens": sum(len(ts) for ts in times.values()), "wall": wall, "tpots": tpots,
            "steps": steps, "blocks": blocks, "pauses": eng.scheduler.pauses,
            "plans": (eng.dyntralb.record or []) if eng.dyntralb is not None else []}
