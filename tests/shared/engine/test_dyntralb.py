"""DyntraLB: the scheduler's pauses and plan-chosen admission, the runtime's step window
and dynamic arming, its snapshot and plan (factory-built requests, no model, no
network). The planner's plans against vLLM-Ascend's: test_dyntralb_plans.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdmesh.shared.engine.dyntralb import (
    DyntraLB,
    RankLoad,
    RankMoves,
    balance_load,
    bubble,
)
from pdmesh.shared.engine.request import RequestStatus
from tests.shared.engine.test_scheduler import make, req, run_step


def test_bubble_in_blocks_and_as_a_ratio():
    assert bubble([10, 20, 30], 5.0) == 10.0
    assert bubble([10, 20, 30], 0.5) == pytest.approx(10 / 30)
    assert bubble([0, 0], 0.5) == 0.0


def moves(out=(), into=(), freeze=None):
    return RankMoves(list(out), list(into), (not into) if freeze is None else freeze)


def blocks(r, bs=4):
    return -(-r.num_tokens // bs)


def test_a_pause_frees_the_seat_and_keeps_the_blocks():
    s = make(budget=64, block_size=4, max_seqs=2)
    a, b, c = req("a", 8), req("b", 8), req("c", 11)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefill
    held = list(s.kv.block_ids(a))
    s.add(c)
    s.lb_snapshot = s.lb_candidates()  # [c]
    s.set_lb_plan(moves(out=[blocks(a)], into=[blocks(c)]))
    out, _ = run_step(s)
    assert a.status is RequestStatus.PAUSED and s.paused == [a] and s.running == [b, c]
    assert c in out.requests and a not in out.requests  # not readmitted the same step
    assert list(s.kv.block_ids(a)) == held and a.num_computed_tokens == 8
    s.set_lb_plan(None)  # no plan: paused requests come back first, when a seat is free
    out, _ = run_step(s)
    assert a not in out.requests  # both seats taken
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    out, _ = run_step(s)
    i = out.requests.index(a)
    assert out.num_tokens[i] == 1 and a.status is RequestStatus.RUNNING  # no recompute
    assert list(s.kv.block_ids(a))[:len(held)] == held and a.num_preemptions == 0


def test_a_plan_admits_only_the_sizes_it_names_in_schedule_order():
    s = make(budget=64, block_size=4)
    x, y, z = req("x", 6), req("y", 10), req("z", 7)  # 2, 3 and 2 blocks
    for r in (x, y, z):
        s.add(r)
    s.lb_snapshot = s.lb_candidates()
    s.set_lb_plan(moves(into=[3]))
    out, _ = run_step(s)
    assert out.requests == [y]  # x waits (not named), y admitted past it
    s.lb_snapshot = s.lb_candidates()
    s.set_lb_plan(moves(into=[2]))
    out, _ = run_step(s)
    assert x in out.requests and z not in out.requests  # the first of that size
    s.lb_snapshot = s.lb_candidates()
    s.set_lb_plan(moves(into=[2], freeze=True))
    out, _ = run_step(s)
    assert z not in out.requests  # frozen: nothing admitted
    s.set_lb_plan(None)
    out, _ = run_step(s)
    assert z in out.requests


def test_a_paused_request_can_be_aborted_and_its_blocks_come_back():
    s = make(budget=64, block_size=4)
    a = req("a", 8)
    s.add(a)
    run_step(s)
    free = s.kv.num_free_blocks
    assert s.pause("a") and not s.pause("a")
    assert s.kv.num_free_blocks == free and s.has_unfinished
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert not s.paused and not s.has_unfinished and s.kv.num_free_blocks > free


def test_a_paused_request_that_cannot_grow_with_nothing_running_is_recomputed():
    s = make(num_blocks=2, budget=64, block_size=4)  # 2 blocks
    a = req("a", 8)
    s.add(a)
    run_step(s)  # 8 prompt tokens fill both blocks; the next token needs a third
    s.pause("a")
    s.set_lb_plan(None)
    out, _ = run_step(s)
    assert out.preempted == [a] and a.status is RequestStatus.WAITING
    assert a.num_computed_tokens == 0 and not s.paused


@dataclass
class _Cfg:
    enabled: bool = True
    enable_diagnostics: bool = True
    mode: str = "static"
    start_step: int = 2
    end_step: int = -1
    bubble_threshold: float = 2.0
    long_req_block_threshold: int = 4
    dynamic_max_step: int = 3


def steps_planned(lb: DyntraLB, longs: list[int]) -> list[bool]:
    """Which of a wave's steps plan, the long request (blocks) seen before each."""
    return [lb.begin_step(x) for x in longs]


def test_static_mode_plans_inside_the_window_of_every_wave():
    lb = DyntraLB(_Cfg(start_step=2, end_step=4), rank=0, world=2, block_size=4,
                  max_num_seqs=4)
    # step k of a wave plans when start <= k - 1 < end (steps completed, as vLLM-Ascend)
    assert steps_planned(lb, [0] * 6) == [False, False, True, True, False, False]
    s = make()
    lb.end_wave(s)  # every rank idle: the count restarts
    assert steps_planned(lb, [0] * 4) == [False, False, True, True]


def test_start_step_zero_still_leaves_the_first_step_of_a_wave_unplanned():
    lb = DyntraLB(_Cfg(start_step=0), rank=0, world=2, block_size=4, max_num_seqs=4)
    assert steps_planned(lb, [0] * 3) == [False, True, True]


def test_dynamic_mode_arms_on_a_long_request_and_disarms_after_quiet_steps():
    lb = DyntraLB(_Cfg(mode="dynamic", start_step=1, dynamic_max_step=3), rank=0, world=2,
                  block_size=4, max_num_seqs=4)
    lb.note_added(16)  # 4 blocks: not above the threshold of 4
    assert lb.pending_long() == 0
    lb.note_added(17)  # 5 blocks
    assert lb.pending_long() == 5
    assert steps_planned(lb, [0, 0]) == [False, False]  # nobody told the all-reduce yet
    # a long request anywhere arms every rank; then dynamic_max_step quiet planning
    # steps (the arming one counts 0) and it disarms after planning the last
    assert steps_planned(lb, [5, 0, 0, 0, 0, 0]) == [True, True, True, True, False, False]
    assert lb.pending_long() == 0
    # another long request re-arms; one during the armed period restarts the count
    assert steps_planned(lb, [9, 0, 9, 0, 0, 0, 0]) == [True, True, True, True, True, True,
                                                        False]


def test_dynamic_arming_survives_the_end_of_a_wave():
    lb = DyntraLB(_Cfg(mode="dynamic", start_step=2, dynamic_max_step=5), rank=0, world=2,
                  block_size=4, max_num_seqs=4)
    assert steps_planned(lb, [7, 0]) == [False, False]  # armed before the window opens
    assert lb.armed
    lb.end_wave(make())
    assert lb.armed and steps_planned(lb, [0, 0, 0]) == [False, False, True]


def test_snapshot_lists_running_then_candidates_and_the_split():
    s = make(budget=64, block_size=4)
    a, b = req("a", 8), req("b", 3)
    s.add(a)
    s.add(b)
    run_step(s)
    s.pause("b")
    c = req("c", 13)
    s.add(c)
    lb = DyntraLB(_Cfg(), rank=0, world=2, block_size=4, max_num_seqs=2)
    row = lb.snapshot(s)
    assert row == [3, 1, 4, 0, 1]  # a running; b (paused) then c waiting; 1 running
    assert s.lb_snapshot == [b, c]


def test_plan_step_applies_this_ranks_moves_and_logs_on_rank_0(caplog):
    s = make(budget=64, block_size=4)
    big, small = req("big", 40), req("small", 4)
    s.add(big)
    s.add(small)
    run_step(s)
    lb = DyntraLB(_Cfg(bubble_threshold=1.0), rank=0, world=2, block_size=4,
                  max_num_seqs=4)
    other = [1] + [0] * 7 + [1]  # rank 1: one 1-block request running
    with caplog.at_level("INFO", logger="pdmesh.shared.engine.dyntralb"):
        mine = lb.plan_step(s, [lb.snapshot(s), other])
    assert mine == balance_load([RankLoad([11, 2]), RankLoad([1])], 4, 1.0)[0]
    assert "modifications" in caplog.text
    run_step(s)
    assert [r.request_id for r in s.paused] == [
        r.request_id for r in (big, small) if blocks(r) in mine.out][:len(mine.out)]
    quiet = DyntraLB(_Cfg(bubble_threshold=1.0), rank=1, world=2, block_size=4,
                     max_num_seqs=4)
    caplog.clear()
    with caplog.at_level("INFO", logger="pdmesh.shared.engine.dyntralb"):
        quiet.plan_step(make(), [lb.snapshot(s), other])
    assert "modifications" not in caplog.text  # diagnostics on rank 0 only


def test_a_wave_ends_at_vllm_s_every_32nd_step_check_and_its_idle_steps_count():
    """Once every rank is idle, vLLM's DP engine core keeps stepping (dummy steps,
    counted and planned) until its step count is a multiple of 32, where it checks that
    all ranks are done and the count restarts; a request arriving before that
    continues the wave, with the count it had."""
    lb = DyntraLB(_Cfg(start_step=25), rank=0, world=2, block_size=4, max_num_seqs=4)
    busy = steps_planned(lb, [0] * 5)
    assert not any(busy) and lb.wave_steps == 5
    tail = []
    while lb.wave_goes_on():  # every rank idle: dummy steps, planned from step 25 on
        tail.append(lb.begin_step(0))
    assert len(tail) == 27 and lb.wave_steps == 32 and tail.count(True) == 7  # 25..31
    lb.end_wave(make())
    assert lb.wave_steps == 0
    # a burst of 20, an idle moment of 3 dummy steps, then a request: the same wave goes
    # on, so its steps 23, 24, 25, 26 follow (a restart would count from 0 again)
    steps_planned(lb, [0] * 20)
    for _ in range(3):
        assert lb.wave_goes_on()
        lb.begin_step(0)
    assert steps_planned(lb, [0] * 4) == [False, False, True, True]


def test_candidates_are_prefetched_then_paused_newest_first_then_waiting():
    """vLLM-Ascend's schedule order: its skipped-waiting queue (prefetched requests whose
    KV is in) before its waiting queue, where each pause goes to the head - so the
    newest pause comes back first; a planning step's snapshot sees loads finished
    since the last step (as its refresh of blocked requests does)."""
    s = make(budget=64, block_size=4, max_seqs=4)
    a, b, c = req("a", 8), req("b", 3), req("c", 6)
    for r in (a, b, c):
        s.add(r)
    run_step(s)
    s.pause("a")
    s.pause("c")
    d = req("d", 5)
    s.add(d)
    assert s.lb_candidates() == [c, a, d]
    s.set_lb_plan(None)
    out, _ = run_step(s)  # no plan: the paused come back, the newest first
    assert out.requests[-3:] == [c, a, d] and not s.paused


def test_a_finished_prefetch_joins_the_same_planning_step_s_snapshot():
    """A pool load that finished between two steps is collected before the snapshot
    (``collect_loads``), not at the next step's schedule."""
    calls = []

    class _Scheduler:
        running: list = []
        lb_snapshot: list = []

        def collect_loads(self):
            calls.append("collect")

        def prefetch_kv(self, limit):
            calls.append("prefetch")

        def lb_candidates(self):
            calls.append("candidates")
            return []

    DyntraLB(_Cfg(), rank=0, world=2, block_size=4, max_num_seqs=2).snapshot(_Scheduler())
    assert calls == ["collect", "prefetch", "candidates"]
