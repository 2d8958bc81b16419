"""FlashLB (vLLM-Ascend's eplb_policy_type 3) placement for placement against its
transcription, its assignment solver against scipy's, and its gain on a workload whose
hot experts run hot together."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from pdmesh.shared.parallel.flash_lb import (
    FlashLB,
    assign_min_cost,
    balance_score,
    keep_in_place,
    statistics,
)
from tests.shared.parallel.vllm_ascend_flash_lb import FlashLBReference


def test_assignment_falls_as_scipy_s_on_ties():
    """Small integer costs (many equal-cost assignments): the same columns as scipy."""
    rng = np.random.default_rng(0)
    for n in range(1, 13):
        for _ in range(30):
            cost = rng.integers(0, 4, size=(n, n))
            _, expected = linear_sum_assignment(cost)
            assert assign_min_cost(cost).tolist() == expected.tolist(), cost
    assert assign_min_cost(np.zeros((5, 5))).tolist() == [0, 1, 2, 3, 4]


def bursty_workload(rng, stages: int, layers: int, table: np.ndarray) -> np.ndarray:
    """[stages, layers, ranks, per_rank] tokens per slot: a few experts hot in turns,
    each burst shared by a pair that runs hot together."""
    num_experts = int(table.max()) + 1
    logical = rng.poisson(3.0, size=(stages, layers, num_experts)).astype(np.int64)
    for t in range(stages):
        for layer in range(layers):
            pair = rng.choice(num_experts, size=2, replace=False) if t % 3 else [layer, 1]
            logical[t, layer, pair] += rng.integers(40, 120)
    slots = np.zeros((stages, *table.shape), dtype=np.int64)
    for layer in range(layers):  # an expert's tokens split over its replicas
        copies = np.bincount(table[layer].ravel(), minlength=num_experts)
        share = logical[:, layer] // copies
        slots[:, layer] = share[:, table[layer]]
    return slots


def hotness_of(table: np.ndarray, workload: np.ndarray) -> np.ndarray:
    """[stages, layers, experts]: the slots' tokens summed per expert, plus one per step,
    as the controller builds it from the ranks' logical counts."""
    stages, layers = workload.shape[:2]
    out = np.zeros((stages, layers, int(table.max()) + 1), dtype=np.int64)
    for t in range(stages):
        for layer in range(layers):
            np.add.at(out[t, layer], table[layer].ravel(), workload[t, layer].ravel())
    return out + 1


def start_table(layers: int, experts: int, ranks: int, per_rank: int) -> np.ndarray:
    slots = np.arange(ranks * per_rank) % experts
    return np.broadcast_to(slots.reshape(ranks, per_rank), (layers, ranks, per_rank)).copy()


@pytest.mark.parametrize("experts, ranks, per_rank, stages", [
    (8, 2, 5, 12), (16, 4, 5, 80), (12, 4, 4, 1), (32, 8, 5, 20), (64, 16, 5, 100)])
def test_placements_match_vllm_ascend_s_call_after_call(experts, ranks, per_rank, stages):
    """Three calls in a row (the layers' ratios remembered between them, the stages cut
    to 64 samples when more): the same table and the same improved layers, in order."""
    rng = np.random.default_rng(experts * 100 + stages)
    layers = 3
    ours, theirs = FlashLB(), FlashLBReference(world_size=ranks)
    table = start_table(layers, experts, ranks, per_rank)
    moved = 0
    for _ in range(3):
        workload = bursty_workload(rng, stages, layers, table)
        changed, priority, expected = theirs.rebalance_experts(table, workload)
        got, improved = ours.rebalance(table, hotness_of(table, workload))
        assert got.tolist() == expected.tolist()
        assert improved == priority.tolist() and changed == bool(improved)
        moved += int((got != table).sum())
        table = got
    assert moved > 0  # the calls did re-place something


def test_flash_lb_spreads_experts_that_run_hot_together():
    """Two experts hot in the same steps start on one rank; FlashLB parts them and the
    score on the same stages drops."""
    rng = np.random.default_rng(7)
    experts, ranks, per_rank, stages = 8, 4, 3, 32
    table = start_table(1, experts, ranks, per_rank)
    table[0, 0, :2] = [0, 1]  # rank 0 holds both of the pair
    logical = rng.poisson(2.0, size=(stages, 1, experts)).astype(np.int64)
    logical[::2, 0, :2] += 100  # experts 0 and 1, hot in the same steps
    hotness = logical + 1
    new, improved = FlashLB().rebalance(table, hotness)
    assert improved == [0]
    ranks_of_0 = {r for r in range(ranks) if 0 in new[0, r]}
    ranks_of_1 = {r for r in range(ranks) if 1 in new[0, r]}
    assert not ranks_of_0 & ranks_of_1
    before = balance_score(hotness[:, 0], np.bincount(table[0].ravel()), table[0])
    after = balance_score(hotness[:, 0], np.bincount(new[0].ravel()), new[0])
    assert after < before - 0.2, (before, after)


def test_keep_in_place_moves_only_what_changes():
    old = np.array([[0, 1, 2], [3, 4, 5]])
    new = np.array([[5, 3, 1], [2, 4, 0]])  # rank 1 shares two experts with old rank 0
    out = keep_in_place(old, new)
    assert out.tolist() == [[0, 4, 2], [3, 1, 5]]


def test_statistics_are_sample_moments():
    x = np.array([[1.0, 2.0], [3.0, 6.0], [5.0, 4.0]])
    mean, var, cov = statistics(x)
    assert mean.tolist() == [3.0, 4.0]
    assert np.allclose(var, np.var(x, axis=0, ddof=1))
    assert np.allclose(cov, np.cov(x.T))
