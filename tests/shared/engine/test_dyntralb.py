"""DyntraLB: the planner on random loads, and the scheduler's pause / resume / admission
cap it drives (factory-built requests, no model, no network)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from pdmesh.shared.engine.dyntralb import (
    DyntraLB,
    RankState,
    apply,
    bubble,
    plan,
)
from tests.shared.engine.test_scheduler import make, req, run_step


def random_states(rng: random.Random, ranks: int, backlog: bool) -> list[RankState]:
    """Rank 0 carries several times the others' KV. Requests are decode-sized (a few
    blocks of 128 tokens each), so a rank can come within a block or two of any level."""
    states = []
    for r in range(ranks):
        heavy = r == 0
        running = [(f"r{r}-{i}", rng.randint(1, 10))
                   for i in range(rng.randint(20, 40) if heavy else rng.randint(4, 12))]
        # decode-side requests of similar size: admission fills to within a few blocks
        waiting = ([(f"w{r}-{i}", rng.randint(1, 3)) for i in range(rng.randint(80, 120))]
                   if backlog else [])
        states.append(RankState(running, [], waiting))
    return states


def ids(states: list[RankState]) -> list[str]:
    return sorted(rid for s in states for part in (s.running, s.paused, s.waiting)
                  for rid, _ in part)


@pytest.mark.parametrize("seed", range(300))
def test_planner_lowers_the_bubble_below_threshold(seed):
    """With waiting work to admit on the light ranks, one plan brings the bubble below
    bubble_threshold; no request is lost or duplicated, none moves between ranks."""
    rng = random.Random(seed)
    states = random_states(rng, rng.randint(2, 8), backlog=True)
    threshold = 5.0
    before = bubble([s.active_blocks for s in states], threshold)
    after_states = apply(states, plan(states, threshold))
    after = bubble([s.active_blocks for s in after_states], threshold)
    assert ids(after_states) == ids(states)
    for s, t in zip(states, after_states, strict=True):
        mine = {rid for part in (s.running, s.paused, s.waiting) for rid, _ in part}
        assert mine == {rid for part in (t.running, t.paused, t.waiting) for rid, _ in part}
        assert t.running, "a rank keeps at least one running request"
    if before > threshold:
        assert after <= threshold, (before, after)


@pytest.mark.parametrize("seed", range(300))
@pytest.mark.parametrize("threshold", [5.0, 0.2])
def test_planner_never_raises_the_bubble(seed, threshold):
    """Without a backlog to admit (and in ratio mode), the bubble never grows."""
    rng = random.Random(1000 + seed)
    states = random_states(rng, rng.randint(2, 6), backlog=False)
    before = bubble([s.active_blocks for s in states], threshold)
    after_states = apply(states, plan(states, threshold))
    after = bubble([s.active_blocks for s in after_states], threshold)
    assert ids(after_states) == ids(states)
    assert after <= before + 1e-9


def test_paused_requests_resume_before_anything_is_admitted():
    states = [RankState([("a", 10)], [("p1", 3), ("p2", 3)], [("w", 1)]),
              RankState([("b", 16)])]
    # levels 10 and 16: mean 13, level 16 (b alone is 16 and must keep running)
    p = plan(states, threshold=2.0)
    assert p[0].resume == ["p1", "p2"] and p[0].pause == []
    assert p[0].admit_blocks == 0 and p[1].pause == [] and p[1].admit_blocks == 0
    after = apply(states, p)
    assert [rid for rid, _ in after[0].running] == ["a", "p1", "p2"]
    assert bubble([s.active_blocks for s in after], 2.0) == 0


def test_bubble_in_blocks_and_as_a_ratio():
    assert bubble([10, 20, 30], 5.0) == 10.0
    assert bubble([10, 20, 30], 0.5) == pytest.approx(10 / 30)
    assert bubble([0, 0], 0.5) == 0.0


def test_scheduler_skips_paused_requests_and_caps_admission():
    s = make(budget=64, block_size=4)
    a, b, c = req("a", 8), req("b", 8), req("c", 8)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefill
    assert s.pause("a") and not s.pause("a") and s.is_paused(a)
    out, _ = run_step(s)
    assert out.requests == [b]  # a keeps its blocks but does not step
    assert s.kv.block_ids(a)
    s.admit_blocks = 2  # c needs 3 blocks (9 tokens / 4 after its first token... 8 -> 2)
    s.add(c)
    s.admit_blocks = 1
    out, _ = run_step(s)
    assert c not in out.requests  # over the cap: frozen for admission
    s.admit_blocks = None
    assert s.resume("a") and not s.resume("a")
    out, _ = run_step(s)
    assert a in out.requests and c in out.requests


def test_finishing_or_preempting_a_paused_request_unpauses_it():
    s = make(budget=64)
    a = req("a", 4, max_tokens=1)
    s.add(a)
    s.pause("a")  # not running yet: nothing to pause
    assert not s.paused
    run_step(s)  # a finishes (max_tokens 1)
    b = req("b", 4)
    s.add(b)
    run_step(s)
    s.pause("b")
    s.finish(b, b.status.__class__.FINISHED_ABORTED)
    assert not s.paused


@dataclass
class _Cfg:
    enabled: bool = True
    enable_diagnostics: bool = True
    mode: str = "static"
    start_step: int = 2
    end_step: int = -1
    bubble_threshold: float = 2.0
    long_req_block_threshold: int = 700
    dynamic_max_step: int = 3


def test_runtime_window_and_dynamic_mode():
    s = make(budget=128, block_size=4)
    for i in range(4):
        s.add(req(f"x{i}", 16))
    run_step(s)
    lb = DyntraLB(_Cfg(), rank=0, world=2, block_size=4)
    lb.on_step(s, [20, 0], long_seen=False)  # step 1: before start_step
    assert not lb.active and not s.paused and s.admit_blocks is None
    lb.on_step(s, [20, 0], long_seen=False)  # step 2: static mode, on
    assert lb.active and s.paused and s.admit_blocks == 0
    lb.on_step(s, [3, 3], long_seen=False)  # balanced: everything resumes
    assert not s.paused and s.admit_blocks is None
    dyn = DyntraLB(_Cfg(mode="dynamic", start_step=0), rank=0, world=2, block_size=4)
    dyn.on_step(s, [20, 0], long_seen=False)
    assert not dyn.active  # dynamic: no long request seen
    dyn.on_step(s, [20, 0], long_seen=True)
    assert dyn.active and s.paused
    for _ in range(3):
        dyn.on_step(s, [20, 0], long_seen=False)
    assert not dyn.active and not s.paused  # dynamic_max_step later it switches off
