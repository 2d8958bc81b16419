"""`pdmesh bench eplb`: what expert imbalance costs two expert-parallel DP ranks, and
what an EPLB placement wins back.

Two rank processes (gloo on loopback, as a `--data-parallel-size 2
--enable-expert-parallel` instance runs them) each decode the same number of random
prompts, greedy, EOS ignored. Four timed passes, in one run:

    off        the start placement (slot s holds expert s % E)
    (record)   the off pass's expert load, summed over the ranks, goes through
               ``rebalance_experts`` (the controller's algorithm); every MoE layer moves
    on         the same prompts on the new placement
    --baseline-model (optional): an unskewed model of the same shape, placement off

For each: decode throughput (generated tokens / decode time), TPOT median and p99 (one
decode step, as the ranks step in lockstep), and balancedness (mean / max tokens per
rank, per MoE layer, averaged) of the placement under the load measured in that pass.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from pdmesh.shared.parallel.ranks import lockstep, run_ranks


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a MoE model (e.g. make-tiny-model "
                                                  "--arch qwen3_moe --expert-skew 0.3)")
    p.add_argument("--baseline-model", default=None,
                   help="the same shape without skew, for the balanced reference")
    p.add_argument("--num-prompts", type=int, default=16, help="per rank")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-redundant-experts", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default=None)


def run(a: argparse.Namespace) -> int:
    results = {"skewed": _bench(a, a.model, rebalance=True)}
    if a.baseline_model:
        results["baseline"] = _bench(a, a.baseline_model, rebalance=False)
    for model, passes in results.items():
        for name, r in passes.items():
            print(f"{model:8s} {name:4s} decode {r['tok_s']:8.1f} tok/s | TPOT median "
                  f"{r['tpot_ms_median']:7.2f} ms p99 {r['tpot_ms_p99']:7.2f} ms | "
                  f"balancedness {r['balancedness']:.3f}")
    skewed = results["skewed"]
    if "on" in skewed:
        gain = skewed["on"]["tok_s"] / skewed["off"]["tok_s"]
        line = f"EPLB on / off: {gain:.2f}x decode throughput"
        if "baseline" in results:
            lost = results["baseline"]["off"]["tok_s"] - skewed["off"]["tok_s"]
            won = skewed["on"]["tok_s"] - skewed["off"]["tok_s"]
            line += (f"; recovers {100 * won / lost:.0f}% of the throughput skew cost"
                     if lost > 0 else "; skew cost nothing to recover")
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _bench(a: argparse.Namespace, model: str, rebalance: bool) -> dict[str, Any]:
    opts = {k: getattr(a, k) for k in ("num_prompts", "input_len", "output_len",
                                       "num_redundant_experts", "threads")}
    return run_ranks(_rank_body, 2, model, opts, rebalance, timeout_s=1800)[0]


def _rank_body(rank: int, world: int, address: str, model: str, opts: dict[str, Any],
               rebalance: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from pdmesh.shared.engine.build import build_engine
    from pdmesh.shared.engine.config import EngineConfig
    from pdmesh.shared.engine.sampling_params import SamplingParams
    from pdmesh.shared.parallel.expert_parallel import LayerPlacement
    from pdmesh.shared.parallel.rebalance import balancedness, rebalance_experts

    torch.set_num_threads(opts["threads"])
    eng = build_engine(EngineConfig(
        model=model, device="cpu", dtype="float32", data_parallel_size=world,
        data_parallel_rank=rank, data_parallel_address=address, enable_expert_parallel=True,
        num_redundant_experts=opts["num_redundant_experts"], expert_load_window=100_000))
    ep, recorder = eng.ep, eng.model.load_recorder
    g = torch.Generator().manual_seed(1000 + rank)
    vocab = eng.model_config.vocab_size
    prompts = [torch.randint(10, vocab - 10, (opts["input_len"],), generator=g).tolist()
               for _ in range(opts["num_prompts"])]
    params = SamplingParams(temperature=0, max_tokens=opts["output_len"], ignore_eos=True)

    def one_pass() -> dict[str, Any]:
        recorder._window.zero_()  # this pass's load only
        for p in prompts:
            eng.add_request(p, params)
        steps: list[float] = []
        generated = 0
        decode_time = 0.0
        for _ in lockstep(eng):
            t0 = time.perf_counter()
            outs = eng.step()
            took = time.perf_counter() - t0
            if outs and all(o.request.num_output_tokens > 1 for o in outs):
                steps.append(took)  # a decode step (first tokens come from prefill steps)
                decode_time += took
                generated += len(outs)
        load = recorder.load()
        total = load.clone()
        dist.all_reduce(total)
        phy2log = torch.stack([p.phy2log for p in ep.placements])
        logcnt = torch.stack([p.logcnt for p in ep.placements])
        tokens = torch.tensor([generated, 0], dtype=torch.float64)
        times = torch.tensor([decode_time], dtype=torch.float64)
        dist.all_reduce(tokens)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        steps.sort()
        return {"tok_s": float(tokens[0] / times[0]),
                "tpot_ms_median": 1000 * statistics.median(steps),
                "tpot_ms_p99": 1000 * steps[min(len(steps) - 1, int(0.99 * len(steps)))],
                "balancedness": float(balancedness(total, phy2log, logcnt, world).mean()),
                "load": total}

    one_pass()  # warm-up
    passes = {"off": one_pass()}
    if rebalance:
        moe = eng.model_config.moe
        placement = rebalance_experts(passes["off"]["load"], ep.num_slots, 1, 1, world)
        for i, row in enumerate(placement.phy2log):
            ep.move_experts(i, row)
        assert all(torch.equal(p.phy2log, LayerPlacement.from_phy2log(
            placement.phy2log[i], moe.num_experts).phy2log) for i, p in enumerate(ep.placements))
        passes["on"] = one_pass()
    dist.destroy_process_group()
    for r in passes.values():
        r.pop("load")
    return passes
