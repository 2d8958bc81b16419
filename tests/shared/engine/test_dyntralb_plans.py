"""pdmesh's DyntraLB planner against a transcription of vLLM-Ascend's: identical plans
(the block counts each rank pauses and admits, and which ranks are frozen) on rank loads
recorded from real runs, on hand-written shapes and on a few hundred generated loads."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pdmesh.shared.engine.dyntralb import RankLoad, balance_load
from tests.shared.engine import vllm_ascend_dyntralb as ascend


def both(loads: list[tuple[list[int], list[int]]], max_num_seqs: int, threshold: float):
    """(pdmesh's plan, vLLM-Ascend's plan) for per-rank (running, waiting) block sizes."""
    ours = balance_load([RankLoad(list(r), list(w)) for r, w in loads], max_num_seqs,
                        threshold)
    theirs = ascend.balance_load([ascend.snapshot(r, w, max_num_seqs) for r, w in loads],
                                 len(loads), max_num_seqs=max_num_seqs, threshold=threshold)
    return ([{"out_blk": m.out, "in_blk": m.into, "freeze": m.freeze} for m in ours],
            theirs)


# Rank loads as rank 0's DyntraLB gathered them in two runs of the DyntraLB benchmark
# (two expert-parallel ranks, tiny Qwen3-MoE, long-tailed outputs; the second with
# 256-token prompts, max_num_seqs 4, threshold 1), with the moves pdmesh planned then:
#   pdmesh bench dyntralb --model M --passes vllm_ascend --record-loads F
#   pdmesh bench dyntralb --model M --passes vllm_ascend --max-num-seqs 4 \
#       --bubble-threshold 1 --seed 1 --input-len 256 --num-prompts 24 --record-loads F
# 944 distinct plans, of which these 140: 80 that pause, 40 that only admit, 20 idle.
RECORDED = [json.loads(line) for line in
            (Path(__file__).parent / "data" / "dyntralb_recorded_loads.jsonl").open()]


def test_the_recording_covers_pauses_admissions_and_both_settings():
    assert len(RECORDED) >= 50
    assert len({json.dumps(r["loads"]) for r in RECORDED}) == len(RECORDED)
    assert sum(any(m["out_blk"] for m in r["moves"]) for r in RECORDED) >= 50
    assert {(r["max_num_seqs"], r["threshold"]) for r in RECORDED} == {(8, 5.0), (4, 1.0)}


@pytest.mark.parametrize("i", range(len(RECORDED)))
def test_recorded_rank_loads_plan_as_vllm_ascend(i):
    r = RECORDED[i]
    ours, theirs = both(r["loads"], r["max_num_seqs"], r["threshold"])
    assert ours == theirs
    assert ours == r["moves"]  # and as pdmesh planned them in the run


# (running per rank, waiting per rank), max_num_seqs, threshold
SHAPES = {
    # the issue's case: a 60- and a 40-block request on one rank, 10 on the other,
    # nothing waiting: the fixed step cost dominates, nothing is paused
    "issue-60-40-vs-10": ([([60, 40], []), ([10], [])], 8, 5.0),
    # vLLM-Ascend's unit tests
    "ut-60-40-vs-60": ([([60, 40], []), ([60], [])], 8, 5.0),
    "ut-drop-4000": ([([4000, 1000], []), ([1000], [])], 8, 1.0),
    "balanced": ([([10, 10], []), ([10, 10], [])], 4, 5.0),
    "all-idle": ([([], []), ([], []), ([], [])], 4, 5.0),
    "one-rank-empty-with-backlog": ([([], [3, 3, 9]), ([30, 2], [1])], 4, 5.0),
    "light-rank-takes-a-big-one": ([([5], [40, 2]), ([50], [])], 2, 5.0),
    "heavy-rank-swaps-down": ([([80, 5], [10, 1]), ([20], [])], 2, 5.0),
    "ratio-threshold": ([([300, 200, 100], [50]), ([20], [10, 400])], 4, 0.2),
    "threshold-exactly-1": ([([7, 1], []), ([1], [1])], 2, 1.0),
    "seats-full": ([([2] * 4, [9, 9]), ([1] * 4, [9])], 4, 5.0),
    "snapshot-truncated": ([([3] * 10, [4] * 10), ([1], [2] * 30)], 5, 2.0),
    "long-tail-16-ranks": ([([700 + 40 * r] if r % 5 == 0 else [30, 12], [8, 64, 2])
                            for r in range(16)], 3, 5.0),
    "equal-sizes-everywhere": ([([8, 8, 8], [8, 8]), ([8], [8, 8, 8])], 4, 5.0),
    "single-rank": ([([50, 3], [9])], 4, 5.0),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_written_shapes_plan_as_vllm_ascend(name):
    loads, max_num_seqs, threshold = SHAPES[name]
    ours, theirs = both(loads, max_num_seqs, threshold)
    assert ours == theirs


def test_the_issue_case_pauses_nothing():
    ours, _ = both(*SHAPES["issue-60-40-vs-10"])
    assert [m["out_blk"] for m in ours] == [[], []]
    assert [m["freeze"] for m in ours] == [True, True]


def test_a_drop_that_raises_throughput_is_taken():
    ours, _ = both(*SHAPES["ut-drop-4000"])
    assert ours[0]["out_blk"] == [4000] and ours[1]["out_blk"] == []


def _long_tailed(rng: random.Random) -> int:
    """KV blocks of a decode request: mostly a few, now and then hundreds."""
    return max(1, int(rng.paretovariate(1.2) * rng.choice((1, 2, 4))))


@pytest.mark.parametrize("seed", range(400))
def test_generated_loads_plan_as_vllm_ascend(seed):
    rng = random.Random(seed)
    world = rng.choice((2, 2, 3, 4, 8, 16))
    max_num_seqs = rng.choice((1, 2, 4, 8, 16, 32))
    threshold = rng.choice((5.0, 5.0, 1.0, 2.0, 20.0, 0.5, 0.2, 0.05))
    heavy = rng.randrange(world)
    loads = []
    for r in range(world):
        n_run = rng.randint(0, max_num_seqs + 2)
        running = [_long_tailed(rng) * (8 if r == heavy else 1) for _ in range(n_run)]
        waiting = [_long_tailed(rng) for _ in range(rng.choice((0, 1, 3, 2 * max_num_seqs)))]
        loads.append((running, waiting))
    ours, theirs = both(loads, max_num_seqs, threshold)
    assert ours == theirs


def test_plans_only_move_requests_a_rank_has():
    rng = random.Random(7)
    for _ in range(100):
        loads = [([_long_tailed(rng) for _ in range(rng.randint(0, 6))],
                  [_long_tailed(rng) for _ in range(rng.randint(0, 6))]) for _ in range(4)]
        ours, _ = both(loads, 6, 5.0)
        for (running, waiting), m in zip(loads, ours, strict=True):
            pool = running + waiting
            for b in m["out_blk"] + m["in_blk"]:
                assert b in pool
                pool.remove(b)
            assert m["freeze"] == (not m["in_blk"])


def test_max_num_seqs_must_be_positive():
    with pytest.raises(ValueError, match="max_num_seqs"):
        balance_load([RankLoad([1])], 0, 5.0)
