"""EPLB policies side by side on synthetic MoE load: how balanced each placement is and
how many expert weights it moves, applied repeatedly as the load drifts.

    .venv/bin/python scripts/bench_eplb_policies.py [--experts 256 --ranks 16
        --redundant 16 --layers 8 --rounds 6 --seed 0]

Each round the load is Zipf over the experts (s = 1.2) with the hot experts drifting
(an eighth of the ranking reshuffled each round), drawn in --stages stages whose hot
experts burst (a sixteenth of the experts, in fixed pairs, one pair a stage drawn at
random, carry a third of the stage's tokens); every policy starts from the start
placement (slot s holds expert s % E, vLLM's and vLLM-Ascend's layout) and re-places
from the placement it chose last; SwiftBalance also from a DeepSeek placement made for
another load (its redundant slots spread over the ranks).
Balancedness is the mean over max tokens per rank (1.0: perfect), over the layers, of
the round's summed load and, "per stage", of each stage's load (what a step meets);
FlashLB (3) decides on the stages, the others on the sum. "moved" counts the slots whose
expert changed. No timings: the figures are the same on any machine.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from pdmesh.services.eplb.controller import placement_balancedness, start_placement
from pdmesh.shared.parallel.flash_lb import FlashLB
from pdmesh.shared.parallel.rebalance import rebalance_experts
from pdmesh.shared.parallel.swift_balance import swift_balance

TOKENS = 200_000  # per layer and round


def drifting_loads(layers: int, experts: int, rounds: int, seed: int,
                   stages: int = 16) -> list[torch.Tensor]:
    """Per round [stages, layers, experts] tokens."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, experts + 1) ** 1.2
    ranking = [rng.permutation(experts) for _ in range(layers)]
    bursty = experts // 16  # experts that burst in pairs, the same pairs every round
    pairs = [rng.permutation(experts)[:bursty].reshape(-1, 2) for _ in range(layers)]
    out = []
    for _ in range(rounds):
        rows = np.zeros((stages, layers, experts), dtype=np.int64)
        for layer in range(layers):
            moved = rng.choice(experts, experts // 8, replace=False)  # the drift
            ranking[layer][moved] = ranking[layer][rng.permutation(moved)]
            per_stage = TOKENS // stages
            for t in range(stages):
                draws = rng.choice(experts, per_stage * 2 // 3, p=w / w.sum())
                rows[t, layer] = np.bincount(ranking[layer][draws], minlength=experts)
                burst = pairs[layer][rng.integers(len(pairs[layer]))]
                rows[t, layer, burst] += per_stage // 6  # a pair bursts
        out.append(torch.tensor(rows))
    return out


def per_stage(stages: torch.Tensor, phy2log: torch.Tensor, ranks: int) -> float:
    return float(np.mean([np.mean(placement_balancedness(s, phy2log, ranks))
                          for s in stages]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--redundant", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stages", type=int, default=16)
    a = p.parse_args()
    slots = a.experts + a.redundant
    start = start_placement(a.layers, a.experts, slots)
    policies = {"none": lambda cur, load: cur,
                "DeepSeek (1)": lambda cur, load: rebalance_experts(
                    load, slots, 1, 1, a.ranks).phy2log,
                "SwiftBalance (2)": lambda cur, load: swift_balance(cur, load, a.ranks)}
    flash = FlashLB()

    def flash_lb(cur: torch.Tensor, stages: torch.Tensor) -> torch.Tensor:
        table = cur.view(a.layers, a.ranks, -1).numpy()
        new, _ = flash.rebalance(table, stages.numpy() + 1)
        return torch.from_numpy(new).reshape(cur.shape).to(torch.int64)
    # SwiftBalance keeps the redundant slots where they are, and the start placement has
    # them all on the last ranks: it is also run from DeepSeek's first placement
    policies["DeepSeek once, then SwiftBalance"] = policies["SwiftBalance (2)"]
    policies["FlashLB (3)"] = flash_lb
    other = drifting_loads(a.layers, a.experts, 1, a.seed + 1, a.stages)[0].sum(0)
    first = rebalance_experts(other, slots, 1, 1, a.ranks).phy2log
    current = dict.fromkeys(policies, start)
    current["DeepSeek once, then SwiftBalance"] = first
    print(f"{a.experts} experts, {a.ranks} ranks, {slots} slots, {a.layers} layers, "
          f"{a.stages} stages a round")
    print("round | policy | balancedness before | after | per stage before | after "
          "| slots moved")
    rounds = drifting_loads(a.layers, a.experts, a.rounds, a.seed, a.stages)
    for i, stages in enumerate(rounds):
        load = stages.sum(0)
        for name, policy in policies.items():
            before = np.mean(placement_balancedness(load, current[name], a.ranks))
            stage_before = per_stage(stages, current[name], a.ranks)
            new = policy(current[name], stages if policy is flash_lb else load)
            after = np.mean(placement_balancedness(load, new, a.ranks))
            moved = int((new != current[name]).sum())
            print(f"{i} | {name} | {before:.3f} | {after:.3f} | {stage_before:.3f} | "
                  f"{per_stage(stages, new, a.ranks):.3f} | {moved}", flush=True)
            current[name] = new


if __name__ == "__main__":
    main()
