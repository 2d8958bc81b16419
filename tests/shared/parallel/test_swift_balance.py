"""vLLM-Ascend's EPLB policies 0 and 2 (shared/parallel/swift_balance.py): the same
placements as vLLM-Ascend's own rules (a transcription of its SwiftBalance, tests/shared/
parallel/vllm_ascend_swift_balance.py) on many placements and loads, redundant slots or
none; every expert stays placed and a rank's kept experts keep their slots. (A layer is
judged by vLLM-Ascend's own estimate against layer 0's mean, so by the true measure it
may come out hotter: the EPLB controller publishes only placements that balance better.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdmesh.shared.parallel.swift_balance import swap_test, swift_balance
from tests.shared.parallel.vllm_ascend_swift_balance import SwiftBalanceReference

SHAPES = [(16, 4, 4), (16, 4, 5), (16, 8, 3), (32, 8, 5), (8, 4, 3), (64, 16, 5), (6, 3, 3)]


def placement(num_layers: int, experts: int, ranks: int, per_rank: int,
              rng: np.random.Generator) -> torch.Tensor:
    """A valid phy2log: every expert once, the redundant slots other experts, no rank
    holding an expert twice."""
    out = []
    for _ in range(num_layers):
        table = np.full((ranks, per_rank), -1)
        slots = rng.permutation(ranks * per_rank)[:experts]
        for e, s in enumerate(slots):
            table[s // per_rank][s % per_rank] = e
        for r in range(ranks):
            for k in range(per_rank):
                if table[r][k] == -1:
                    table[r][k] = rng.choice([e for e in range(experts) if e not in table[r]])
        out.append(table.reshape(-1))
    return torch.tensor(np.array(out), dtype=torch.int64)


def loads(num_layers: int, experts: int, rng: np.random.Generator, kind: str) -> torch.Tensor:
    if kind == "zipf":
        w = 1.0 / np.arange(1, experts + 1) ** 1.2
        rows = [np.bincount(rng.permutation(experts)[rng.choice(experts, 5000, p=w / w.sum())],
                            minlength=experts) for _ in range(num_layers)]
        return torch.tensor(np.array(rows), dtype=torch.int64)
    if kind == "ties":  # few distinct values: ties everywhere
        return torch.tensor(rng.choice([10, 20, 40], (num_layers, experts)), dtype=torch.int64)
    return torch.tensor(rng.integers(0, 1000, (num_layers, experts)), dtype=torch.int64)


def reference(phy2log: torch.Tensor, load: torch.Tensor, ranks: int) -> torch.Tensor:
    """vLLM-Ascend's answer: its table [layer, rank, slot], each expert's load on its
    first slot (the worker sums the slots' loads per expert)."""
    table = phy2log.view(phy2log.shape[0], ranks, -1).numpy()
    workload = np.zeros(table.shape, dtype=np.int64)
    for layer in range(table.shape[0]):
        seen = set()
        for r in range(ranks):
            for k in range(table.shape[2]):
                e = int(table[layer][r][k])
                if e not in seen:
                    seen.add(e)
                    workload[layer][r][k] = int(load[layer][e])
    new = SwiftBalanceReference().rebalance_experts(table, workload)
    return torch.tensor(new, dtype=torch.int64).reshape(phy2log.shape)


def max_rank_load(phy2log: torch.Tensor, load: torch.Tensor, ranks: int) -> torch.Tensor:
    copies = torch.zeros_like(load, dtype=torch.float64).scatter_add_(
        1, phy2log, torch.ones_like(phy2log, dtype=torch.float64))
    per_slot = load.double().gather(1, phy2log) / copies.gather(1, phy2log)
    return per_slot.view(load.shape[0], ranks, -1).sum(-1).max(-1).values


@pytest.mark.parametrize("kind", ["zipf", "uniform", "ties"])
@pytest.mark.parametrize(("experts", "ranks", "per_rank"), SHAPES)
def test_swift_balance_places_as_vllm_ascend_does(experts, ranks, per_rank, kind):
    rng = np.random.default_rng(experts * 1000 + ranks * 10 + per_rank)
    for _ in range(6):
        phy2log = placement(3, experts, ranks, per_rank, rng)
        load = loads(3, experts, rng, kind)
        got = swift_balance(phy2log, load, ranks)
        assert torch.equal(got, reference(phy2log, load, ranks))
        # every expert still placed, no rank holding one twice, kept experts not moved
        for layer in range(3):
            assert set(got[layer].tolist()) == set(range(experts))
            table, was = got[layer].view(ranks, -1), phy2log[layer].view(ranks, -1)
            for r in range(ranks):
                assert len(set(table[r].tolist())) == per_rank
                kept = torch.isin(table[r], was[r])
                assert torch.equal(table[r][kept], was[r][torch.isin(was[r], table[r])])


def test_swift_balance_cools_a_skewed_layer():
    # 8 experts on 4 ranks, the two hottest on rank 0
    phy2log = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    load = torch.tensor([[400, 300, 10, 10, 10, 10, 10, 10]])
    got = swift_balance(phy2log, load, 4)
    assert max_rank_load(got, load, 4) < max_rank_load(phy2log, load, 4)
    assert torch.equal(got, reference(phy2log, load, 4))


def test_the_test_policy_swaps_ranks_3_and_1_last_slots():
    phy2log = torch.arange(8).view(1, 8).repeat(2, 1)  # 4 ranks of 2
    got = swap_test(phy2log, 4)
    assert got[0].tolist() == [0, 1, 2, 7, 4, 5, 6, 3]
    assert torch.equal(got[0], got[1])
    with pytest.raises(ValueError, match="eplb_policy_type: 0 swaps"):
        swap_test(torch.arange(6).view(1, 6), 3)
