"""Waiting-queue policies with factory-built requests: ShortRequestFirst's lanes, FCFS
inside a lane, aging on an injected clock, the threshold boundary; priority both ways;
and the scheduler admitting in the policy's order."""

from __future__ import annotations

import pytest

from pdmesh.shared.engine.block_manager import KVCacheManager
from pdmesh.shared.engine.config import EngineConfig
from pdmesh.shared.engine.policy import (
    PriorityPolicy,
    ShortRequestFirstPolicy,
    has_progress,
    policy_from_config,
)
from pdmesh.shared.engine.request import Request
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.engine.scheduler import Scheduler

THRESHOLD = 8


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def req(rid: str, n: int, priority: int = 0, t: float = 0.0) -> Request:
    return Request(rid, [10 + i for i in range(n)], SamplingParams(max_tokens=4),
                   priority=priority, arrival_time=t)


def drain(policy) -> list[str]:
    out = []
    while len(policy):
        assert policy.peek() is policy.peek()
        out.append(policy.pop().request_id)
    return out


def srf(wait_ms: float = 0.0, clock: Clock | None = None) -> ShortRequestFirstPolicy:
    return ShortRequestFirstPolicy(THRESHOLD, wait_ms, clock or Clock())


def test_short_before_long_fcfs_inside_each_lane():
    p = srf()
    for rid, n in [("L1", 50), ("s1", 3), ("L2", 9), ("s2", THRESHOLD), ("s3", 1)]:
        p.add(req(rid, n))
    assert len(p) == 5
    assert drain(p) == ["s1", "s2", "s3", "L1", "L2"]


def test_threshold_boundary():
    p = srf()
    p.add(req("over", THRESHOLD + 1))
    p.add(req("at", THRESHOLD))
    assert drain(p) == ["at", "over"]  # at most `threshold` tokens is short


def test_preempted_and_resuming_requests_go_first():
    p = srf()
    short, long_ = req("s", 2), req("L", 40)
    p.add(short)
    p.add(long_)
    preempted = req("pre", 60)
    preempted.num_preemptions = 1  # what Scheduler._preempt leaves behind
    p.readd(preempted)
    resumed = req("res", 60)
    resumed.append_token(5)  # arrives with generated tokens (a continuation)
    assert has_progress(resumed) and has_progress(preempted) and not has_progress(short)
    p.add(resumed)
    later = req("pre2", 60)
    later.num_preemptions = 1
    p.readd(later)  # readd puts it at the head of the immediate lane
    assert drain(p) == ["pre2", "pre", "res", "s", "L"]


def test_long_requests_are_never_promoted_with_zero_wait():
    clock = Clock()
    p = srf(0.0, clock)
    p.add(req("L", 40))
    clock.now += 3600
    p.add(req("s", 2))
    assert drain(p) == ["s", "L"] and p.aged_promotions == 0


def test_aged_long_request_goes_before_short_ones_but_after_immediate():
    clock = Clock()
    p = srf(250.0, clock)  # times below are exact binary fractions of a second
    p.add(req("L1", 40))
    clock.now += 0.125
    p.add(req("L2", 40))
    p.add(req("s1", 2))
    p.add(req("s2", 2))
    assert p.peek().request_id == "s1"  # L1 has waited 125 ms of 250
    clock.now += 0.125  # L1: 250 ms, aged (at exactly the limit); L2: 125 ms
    assert p.peek().request_id == "L1"
    imm = req("imm", 2)
    imm.num_preemptions = 1
    p.readd(imm)
    assert p.pop().request_id == "imm"
    assert p.pop().request_id == "L1" and p.aged_promotions == 1
    assert p.peek().request_id == "s1"  # L2 not aged yet
    clock.now += 0.125
    assert drain(p) == ["L2", "s1", "s2"]


def test_three_aged_promotions_in_a_row_warn_once(caplog):
    clock = Clock()
    p = srf(100.0, clock)
    for i in range(5):
        p.add(req(f"L{i}", 40))
    p.add(req("s", 2))
    clock.now += 1.0  # every long request has aged; a short one waits behind them
    with caplog.at_level("WARNING", logger="pdmesh.shared.engine.policy"):
        assert [p.pop().request_id for _ in range(2)] == ["L0", "L1"]
        assert "degrade toward long-request priority" not in caplog.text
        assert p.pop().request_id == "L2"
        assert caplog.text.count("degrade toward long-request priority") == 1
        p.pop()
        assert caplog.text.count("degrade toward long-request priority") == 1  # once
    assert p.aged_promotions == 4


def test_a_short_dispatch_breaks_the_aged_streak(caplog):
    clock = Clock()
    p = srf(100.0, clock)
    for rid, n in [("L0", 40), ("L1", 40), ("s0", 2)]:
        p.add(req(rid, n))
    clock.now += 1.0
    with caplog.at_level("WARNING", logger="pdmesh.shared.engine.policy"):
        assert [p.pop().request_id for _ in range(2)] == ["L0", "L1"]  # a streak of two
        p.add(req("L2", 40))
        assert p.pop().request_id == "s0"  # L2 has not aged: the short one, streak over
        clock.now += 1.0
        p.add(req("s1", 2))
        assert p.pop().request_id == "L2"  # aged ahead of s1: a streak of one
        assert "degrade" not in caplog.text
    assert p.aged_promotions == 3


def test_stats_are_logged_on_queue_events_at_most_every_five_seconds(caplog):
    clock = Clock()
    with caplog.at_level("INFO", logger="pdmesh.shared.engine.policy"):
        p = srf(0.0, clock)
        assert "ShortRequestFirst waiting queue installed: threshold=8" in caplog.text
        p.add(req("a", 2))
        clock.now += 4.9
        p.add(req("b", 40))
        assert "ShortRequestFirst stats" not in caplog.text
        clock.now += 0.2
        p.pop()
        assert caplog.text.count("ShortRequestFirst stats") == 1
        assert "sizes=(immediate=0 short=0 long=1)" in caplog.text
        assert "dispatches={'immediate': 0, 'short': 1, 'long': 0}" in caplog.text
        clock.now += 1.0
        p.pop()
        assert caplog.text.count("ShortRequestFirst stats") == 1


def test_pop_takes_what_peek_returned_even_if_aging_flips():
    clock = Clock()
    p = srf(100.0, clock)
    p.add(req("L", 40))
    p.add(req("s", 2))
    assert p.peek().request_id == "s"
    clock.now += 1.0  # L ages between peek and pop
    assert p.pop().request_id == "s"
    assert p.pop().request_id == "L"


def test_remove_and_victim():
    p = srf()
    a, b, c = req("a", 2), req("b", 40), req("c", 3)
    for r in (a, b, c):
        p.add(r)
    p.remove(b)
    with pytest.raises(ValueError):
        p.remove(b)
    assert {r.request_id for r in p} == {"a", "c"}
    assert p.victim([a, c]) is c  # FCFS: the latest admitted yields
    assert drain(p) == ["a", "c"]


@pytest.mark.parametrize(("low_first", "order"), [(True, ["hi", "mid", "lo"]),
                                                   (False, ["lo", "mid", "hi"])])
def test_priority_order_both_ways(low_first, order):
    p = PriorityPolicy(low_values_first=low_first)
    # "lo" has the largest value, "hi" the smallest; "mid2" ties "mid" but came later
    rs = [req("lo", 2, priority=5, t=0), req("hi", 2, priority=-1, t=1),
          req("mid", 2, priority=0, t=2), req("mid2", 2, priority=0, t=3)]
    for r in rs:
        p.add(r)
    got = drain(p)
    assert [x for x in got if x != "mid2"] == order
    assert got.index("mid2") == got.index("mid") + 1  # FCFS among equals
    assert p.victim(rs).request_id == order[-1]  # the one scheduled last yields


def test_policy_from_config_and_bad_fields():
    cfg = EngineConfig(model="m", scheduling_policy="short_request_first",
                       short_request_threshold=32, short_request_long_max_wait_ms=500.0)
    p = policy_from_config(cfg)
    assert isinstance(p, ShortRequestFirstPolicy)
    assert (p.threshold, p.long_max_wait_ms) == (32, 500.0)
    prio = policy_from_config(EngineConfig(model="m", scheduling_policy="priority",
                                           priority_low_values_first=False))
    assert isinstance(prio, PriorityPolicy) and not prio.low_values_first
    for field, value in [("scheduling_policy", "sjf"), ("short_request_threshold", -1),
                         ("short_request_long_max_wait_ms", -5.0),
                         ("max_queued_requests", 0)]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(model="m", **{field: value}).validate()


def test_scheduler_admits_short_prompts_first():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(kv, srf(), max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256)
    long_, short = req("L", 30), req("s", 4)
    s.add(long_)
    s.add(short)
    out = s.schedule()
    assert out.requests == [short]  # one seat: the short prompt takes it
    assert list(s.waiting) == [long_]
