"""EPLB policies side by side on synthetic MoE load: how balanced each placement is and
how many expert weights it moves, applied repeatedly as the load drifts.

    .venv/bin/python scripts/bench_eplb_policies.py [--experts 256 --ranks 16
        --redundant 16 --layers 8 --rounds 6 --seed 0]

Each round the load is Zipf over the experts (s = 1.2) with the hot experts drifting
(an eighth of the ranking reshuffled each round); every policy starts from the start
placement (slot s holds expert s % E, vLLM's and vLLM-Ascend's layout) and re-places
from the placement it chose last; SwiftBalance also from a DeepSeek placement made for
another load (its redundant slots spread over the ranks).
Balancedness is the mean over max tokens per rank (1.0: perfect), over the layers;
"moved" counts the slots whose expert changed. No timings: the figures are the same on
any machine.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from pdmesh.services.eplb.controller import placement_balancedness, start_placement
from pdmesh.shared.parallel.rebalance import rebalance_experts
from pdmesh.shared.parallel.swift_balance import swift_balance


def drifting_loads(layers: int, experts: int, rounds: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, experts + 1) ** 1.2
    ranking = [rng.permutation(experts) for _ in range(layers)]
    out = []
    for _ in range(rounds):
        rows = []
        for layer in range(layers):
            moved = rng.choice(experts, experts // 8, replace=False)  # the drift
            ranking[layer][moved] = ranking[layer][rng.permutation(moved)]
            draws = rng.choice(experts, 200_000, p=w / w.sum())
            rows.append(np.bincount(ranking[layer][draws], minlength=experts))
        out.append(torch.tensor(np.array(rows), dtype=torch.int64))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--redundant", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    slots = a.experts + a.redundant
    start = start_placement(a.layers, a.experts, slots)
    policies = {"none": lambda cur, load: cur,
                "DeepSeek (1)": lambda cur, load: rebalance_experts(
                    load, slots, 1, 1, a.ranks).phy2log,
                "SwiftBalance (2)": lambda cur, load: swift_balance(cur, load, a.ranks)}
    # SwiftBalance keeps the redundant slots where they are, and the start placement has
    # them all on the last ranks: it is also run from DeepSeek's first placement
    policies["DeepSeek once, then SwiftBalance"] = policies["SwiftBalance (2)"]
    first = rebalance_experts(drifting_loads(a.layers, a.experts, 1, a.seed + 1)[0], slots,
                              1, 1, a.ranks).phy2log
    current = dict.fromkeys(policies, start)
    current["DeepSeek once, then SwiftBalance"] = first
    print(f"{a.experts} experts, {a.ranks} ranks, {slots} slots, {a.layers} layers")
    print("round | policy | balancedness before | after | slots moved")
    for i, load in enumerate(drifting_loads(a.layers, a.experts, a.rounds, a.seed)):
        for name, policy in policies.items():
            before = np.mean(placement_balancedness(load, current[name], a.ranks))
            new = policy(current[name], load)
            after = np.mean(placement_balancedness(load, new, a.ranks))
            moved = int((new != current[name]).sum())
            print(f"{i} | {name} | {before:.3f} | {after:.3f} | {moved}")
            current[name] = new


if __name__ == "__main__":
    main()
