#!/usr/bin/env python3
"""SGLang's --schedule-policy on a shared-prefix workload: prefix-cache hit rate and wall
time of fcfs, lpm, lof and random, on one engine (offline, every request at once, the
box full), with the cache able to hold only some of the prefixes at a time.

    .venv/bin/python scripts/bench_schedule_policy.py --model /tmp/bench/qwen3

Workload: G groups of R requests, each group sharing a P-token prefix plus a short
suffix of its own, arriving interleaved (one of each group in turn); 16 new tokens each.
The KV cache holds ``--cache-prefixes`` prefixes' worth of blocks plus the running
requests' own. The ideal hit rate is (R - 1) / R of the prefix tokens.
"""

from __future__ import annotations

import argparse
import time

from pdmesh.shared.engine import LLM, SamplingParams


def workload(groups: int, per_group: int, prefix: int) -> list[list[int]]:
    heads = [[11 + g] * 4 + [50 + (37 * g + 13 * j) % 3000 for j in range(prefix - 4)]
             for g in range(groups)]  # (ids below 4096: the tiny models' vocabulary)
    return [heads[g] + [3100 + 7 * i + g, 3600 + i, 3700 + g] for i in range(per_group)
            for g in range(groups)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=6)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--cache-prefixes", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policies", nargs="+", default=["fcfs", "lpm", "lof", "random"])
    a = p.parse_args()
    prompts = workload(a.groups, a.per_group, a.prefix)
    block = a.block_size
    blocks = (a.cache_prefixes * a.prefix + a.max_num_seqs * (a.prefix + 32)) // block
    total = sum(len(x) for x in prompts)
    ideal = a.groups * (a.per_group - 1) * (a.prefix // block * block) / total
    print(f"{len(prompts)} prompts, {total} prompt tokens, {blocks} KV blocks; "
          f"ideal hit rate {ideal:.3f}")
    for policy in a.policies:
        llm = LLM(a.model, device="cpu", dtype="bfloat16", block_size=block,
                  num_kv_blocks=blocks, max_num_seqs=a.max_num_seqs,
                  scheduling_policy=policy)
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, sp)
        took = time.perf_counter() - start
        hit = sum(o.num_cached_tokens for o in outs) / total
        print(f"{policy:7s} hit rate {hit:.3f}  wall {took:6.2f} s")


if __name__ == "__main__":
    main()
