"""SGLang's priority preemption (``--enable-priority-scheduling`` with
``--priority-scheduling-preemption-threshold``): a waiting request that finds no seat or
no KV blocks preempts the running requests it outranks by more than the threshold - the
worst first, the fewest that suffice, none if they do not suffice - and a request that
gives no priority runs with the engine's default."""

from __future__ import annotations

import itertools
import logging

import pytest

from pdmesh.shared.engine.block_manager import KVCacheManager
from pdmesh.shared.engine.llm import LLM
from pdmesh.shared.engine.policy import FCFSPolicy, PriorityPolicy
from pdmesh.shared.engine.request import Request, RequestStatus
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.engine.scheduler import Scheduler


def make(threshold: int | None = 10, low_first: bool = True, num_blocks: int = 64,
         max_seqs: int = 2, budget: int = 64) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=True)
    policy = PriorityPolicy(low_values_first=low_first, preemption_threshold=threshold)
    return Scheduler(kv, policy, max_seqs, budget, 512)


_first_token = itertools.count(100, 100)


def req(rid: str, n: int, priority: int, t: float, max_tokens: int = 20) -> Request:
    first = next(_first_token)  # no two requests share a prefix
    return Request(rid, list(range(first, first + n)),
                   SamplingParams(max_tokens=max_tokens), eos_token_ids=(2,),
                   priority=priority, arrival_time=t)


def step(s: Scheduler):
    out = s.schedule()
    sampled = {i: 7 for i, (r, n) in enumerate(zip(out.requests, out.num_tokens, strict=True))
               if r.num_computed_tokens + n == r.num_tokens}
    s.update(out, sampled)
    return out


def drain(s: Scheduler) -> None:
    for _ in range(500):
        if not s.has_unfinished:
            return
        step(s)
    raise AssertionError("requests never finished")


def test_outranked_orders_worst_first_and_stops_at_the_threshold():
    p = PriorityPolicy(low_values_first=True, preemption_threshold=10)
    a, b, c, d = req("a", 4, 20, 0), req("b", 4, 30, 1), req("c", 4, 30, 2), req("d", 4, 10, 3)
    new = req("n", 4, 0, 9)
    # worst (largest value) first, the later of equals first; d is only 10 worse: kept
    assert p.outranked(new, [a, b, c, d]) == [c, b, a]
    high = PriorityPolicy(low_values_first=False, preemption_threshold=10)
    new_high = req("h", 4, 35, 9)  # larger values first: outranks a (15) only
    assert high.outranked(new_high, [a, b, c, d]) == [d, a]
    assert PriorityPolicy().outranked(new, [a, b]) == []  # no threshold: never
    assert FCFSPolicy().outranked(new, [a, b]) == []
    with pytest.raises(ValueError, match="preemption_threshold: must be >= 0"):
        PriorityPolicy(preemption_threshold=-1)


def test_a_waiting_request_takes_the_seat_of_the_worst_running_one():
    s = make(max_seqs=2)
    lo1, lo2 = req("lo1", 6, 50, 0), req("lo2", 6, 40, 1)
    s.add(lo1)
    s.add(lo2)
    step(s)
    step(s)
    assert set(s.running) == {lo1, lo2}
    hi = req("hi", 6, 0, 2)
    s.add(hi)
    out = step(s)
    assert out.preempted == [lo1]  # the worst priority
    assert hi in out.requests and lo2 in out.requests and lo1 not in out.requests
    assert lo1.status is RequestStatus.WAITING and lo1.num_computed_tokens == 0
    assert s.kv.block_ids(lo1) == [] and s.priority_preemptions == 1
    drain(s)
    for r in (lo1, lo2, hi):
        assert r.is_finished and r.num_output_tokens == 20
    assert s.kv.num_free_blocks == s.kv.num_blocks


@pytest.mark.parametrize(("gap", "preempts"), [(10, False), (11, True)])
def test_the_priority_gap_must_exceed_the_threshold(gap, preempts):
    s = make(max_seqs=1)
    lo = req("lo", 6, gap, 0)
    s.add(lo)
    step(s)
    hi = req("hi", 6, 0, 1)
    s.add(hi)
    out = step(s)
    assert (out.preempted == [lo]) is preempts
    assert (out.requests == [hi]) is preempts
    assert s.running == ([hi] if preempts else [lo])


def test_larger_values_first_preempts_the_smallest():
    s = make(low_first=False, max_seqs=2)
    a, b = req("a", 6, 5, 0), req("b", 6, 1, 1)
    s.add(a)
    s.add(b)
    step(s)
    s.add(req("hi", 6, 30, 2))
    out = step(s)
    assert out.preempted == [b]


def test_blocks_the_fewest_victims_that_suffice():
    # 12 blocks of 4 tokens; three running requests of 15 tokens hold 4 blocks each (their
    # next token fits the last one)
    s = make(num_blocks=12, max_seqs=8)
    rs = [req(f"r{i}", 15, 20 + i, i) for i in range(3)]
    for r in rs:
        s.add(r)
    step(s)
    assert s.kv.num_free_blocks == 0 and len(s.running) == 3
    hi = req("hi", 12, 0, 9)  # 3 blocks: one victim frees enough
    s.add(hi)
    out = step(s)
    assert out.preempted == [rs[2]]
    assert hi in out.requests and set(s.running) == {rs[0], rs[1], hi}
    drain(s)
    assert all(r.is_finished and r.num_output_tokens == 20 for r in [*rs, hi])
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_nothing_is_preempted_when_the_outranked_cannot_free_enough():
    s = make(num_blocks=12, max_seqs=8)
    mid, low = req("mid", 23, 5, 0), req("low", 23, 50, 1)  # 6 blocks each
    s.add(mid)
    s.add(low)
    step(s)
    assert s.kv.num_free_blocks == 0
    hi = req("hi", 40, 0, 2)  # 10 blocks: only low (6) is outranked by more than 10
    s.add(hi)
    out = step(s)
    assert out.preempted == [] and s.priority_preemptions == 0
    assert set(s.running) == {mid, low} and hi.status is RequestStatus.WAITING


def test_vllm_priority_policy_never_preempts_for_a_waiting_request():
    s = make(threshold=None, max_seqs=1)
    lo = req("lo", 6, 100, 0)
    s.add(lo)
    step(s)
    s.add(req("hi", 6, 0, 1))
    out = step(s)
    assert out.preempted == [] and s.running == [lo]


def test_a_victim_scheduled_earlier_in_the_step_leaves_the_batch():
    # the running request's decode token is scheduled first, then withdrawn
    s = make(max_seqs=1, budget=8)
    lo = req("lo", 6, 50, 0)
    s.add(lo)
    step(s)
    hi = req("hi", 12, 0, 1)
    s.add(hi)
    out = step(s)
    assert out.requests == [hi] and out.num_tokens == [7]  # the budget lo left it
    assert out.preempted == [lo] and lo.num_output_tokens == 1
    assert s.kv.block_ids(lo) == []


# -- the engine: requests without a priority, and answers unchanged --------------------
@pytest.fixture(scope="module")
def sglang_llm(qwen3_path):
    return LLM(str(qwen3_path), device="cpu", block_size=16, max_num_seqs=2,
               num_kv_blocks=64, scheduling_policy="priority",
               priority_low_values_first=True, priority_preemption_threshold=10,
               default_priority=100)


def test_preempted_requests_answer_as_if_never_preempted(sglang_llm, qwen3_path):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24]]
    reference = LLM(str(qwen3_path), device="cpu", block_size=16, num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, greedy)]

    engine = sglang_llm.engine
    before = engine.scheduler.priority_preemptions
    low = [engine.add_request(p, greedy) for p in prompts[:2]]  # default priority 100
    assert [r.priority for r in low] == [100, 100]
    for _ in range(4):
        engine.step()
    high = engine.add_request(prompts[2], greedy, priority=0)
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.priority_preemptions == before + 1
    assert sum(r.num_preemptions for r in low) == 1
    assert [list(r.output_token_ids) for r in [*low, high]] == want


def test_priority_on_an_engine_that_ignores_it(qwen3_path, caplog):
    greedy = SamplingParams(temperature=0, max_tokens=2)
    fcfs = LLM(str(qwen3_path), device="cpu", block_size=16, num_kv_blocks=16)
    with caplog.at_level(logging.WARNING):
        r = fcfs.engine.add_request([5, 6, 7], greedy, request_id="p3", priority=3)
    assert r.priority == 3
    assert "request p3: priority 3 has no effect" in caplog.text
    strict = LLM(str(qwen3_path), device="cpu", block_size=16, num_kv_blocks=16,
                 abort_on_priority_when_disabled=True)
    with pytest.raises(ValueError, match="^priority: this engine does not schedule by"):
        strict.engine.add_request([5, 6, 7], greedy, priority=0)
    assert strict.engine.add_request([5, 6, 7], greedy).priority == 0  # none given: runs
    with pytest.raises(ValueError, match="priority: must be an integer"):
        fcfs.engine.add_request([5, 6, 7], greedy, priority="high")
