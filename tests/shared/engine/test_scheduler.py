"""The scheduler and its policies with factory-built requests (no model)."""

from __future__ import annotations

from pdmesh.shared.engine.block_manager import KVCacheManager
from pdmesh.shared.engine.policy import FCFSPolicy, PriorityPolicy, make_policy
from pdmesh.shared.engine.request import Request, RequestStatus
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.engine.scheduler import Scheduler


def make(num_blocks=64, block_size=4, max_seqs=8, budget=32, policy="fcfs", max_len=256):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    return Scheduler(kv, make_policy(policy), max_seqs, budget, max_len)


def req(rid: str, n: int, priority: int = 0, t: float = 0.0, **sp) -> Request:
    sp.setdefault("max_tokens", 100)
    r = Request(rid, [1000 + hash(rid) % 1000 + i for i in range(n)], SamplingParams(**sp),
                eos_token_ids=(2,), priority=priority, arrival_time=t)
    return r


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {i: token for i, (r, n) in enumerate(zip(out.requests, out.num_tokens, strict=True))
               if r.num_computed_tokens + n == r.num_tokens}
    finished = s.update(out, sampled)
    return out, finished


def test_budget_and_chunked_prefill():
    s = make(budget=10)
    a, b = req("a", 25), req("b", 3)
    s.add(a)
    s.add(b)
    out, _ = run_step(s)
    assert out.requests == [a] and out.num_tokens == [10]  # a takes the whole budget
    out, _ = run_step(s)
    assert out.requests == [a] and out.num_tokens == [10]
    out, _ = run_step(s)
    assert out.requests == [a, b] and out.num_tokens == [5, 3]  # a's last chunk, then b
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    out, _ = run_step(s)
    assert out.num_tokens == [1, 1] and out.total_tokens == 2  # both decoding


def test_max_num_seqs_caps_the_batch():
    s = make(max_seqs=2, budget=100)
    rs = [req(str(i), 3) for i in range(4)]
    for r in rs:
        s.add(r)
    out, _ = run_step(s)
    assert out.requests == rs[:2] and len(s.waiting) == 2


def test_preemption_recomputes_and_keeps_order():
    # 6 blocks of 4 tokens: two requests of 9 tokens need 3 blocks each, then grow.
    s = make(num_blocks=6, block_size=4, budget=64)
    a, b = req("a", 9, max_tokens=10), req("b", 9, max_tokens=10)
    s.add(a)
    s.add(b)
    seen_preempt = False
    for _ in range(40):
        out, _ = run_step(s)
        if out.preempted:
            seen_preempt = True
            assert out.preempted == [b]  # FCFS: the later request yields
            assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
            assert s.kv.block_ids(b) == []
        if not s.has_unfinished:
            break
    assert seen_preempt
    assert a.is_finished and b.is_finished
    assert a.num_output_tokens == 10 and b.num_output_tokens == 10
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_priority_policy_orders_and_picks_victim():
    p = PriorityPolicy()
    lo, hi, mid = req("lo", 2, priority=5, t=0), req("hi", 2, priority=-1, t=1), req("m", 2, 0, 2)
    for r in (lo, hi, mid):
        p.add(r)
    assert [p.pop() for _ in range(3)] == [hi, mid, lo]
    assert p.victim([hi, lo, mid]) is lo
    f = FCFSPolicy()
    f.add(lo)
    f.add(hi)
    f.readd(mid)  # a preempted request goes first
    assert list(f) == [mid, lo, hi]


def test_stop_conditions():
    s = make()
    r = req("r", 3, max_tokens=5, stop_token_ids=[9], min_tokens=2)
    s.add(r)
    _, fin = run_step(s, token=9)  # a stop token before min_tokens does not stop
    assert not fin
    _, fin = run_step(s, token=9)
    assert fin == [r] and r.finish_reason == "stop" and r.stop_reason == 9
    e = req("e", 3, max_tokens=5)
    s.add(e)
    _, fin = run_step(s, token=2)  # eos
    assert fin == [e] and e.finish_reason == "stop" and e.stop_reason is None
    n = req("n", 3, max_tokens=3, ignore_eos=True)
    s.add(n)
    for _ in range(3):
        _, fin = run_step(s, token=2)
    assert fin == [n] and n.finish_reason == "length"
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_max_model_len_stops_generation():
    s = make(max_len=6)
    r = req("r", 4, max_tokens=50)
    s.add(r)
    for _ in range(5):
        run_step(s)
    assert r.finish_reason == "length" and r.num_tokens == 6


def test_abort_waiting_and_running_frees_blocks():
    s = make()
    a, b = req("a", 5), req("b", 5)
    s.add(a)
    run_step(s)
    s.add(b)
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    assert a.finish_reason == "abort" and b.finish_reason == "abort"
    assert not s.has_unfinished and s.kv.num_free_blocks == s.kv.num_blocks


def test_recompute_scheduler_hands_the_victim_back():
    """With the recompute scheduler (decode instances) the request that would be
    preempted finishes as "recomputed" with its tokens so far, and frees its blocks."""
    s = make(num_blocks=6, block_size=4, budget=64)
    s.recompute_elsewhere = True
    a, b = req("a", 9, max_tokens=10), req("b", 9, max_tokens=10)
    s.add(a)
    s.add(b)
    handed = []
    for _ in range(40):
        out, _ = run_step(s)
        handed += s.handed_back
        s.handed_back.clear()
        if not s.has_unfinished:
            break
    assert handed == [b]  # FCFS: the later request is the victim
    assert b.status is RequestStatus.FINISHED_RECOMPUTED and b.finish_reason == "recomputed"
    assert 0 < b.num_output_tokens < 10 and s.kv.block_ids(b) == []
    assert len(s.waiting) == 0  # not queued here to be recomputed
    assert a.is_finished and a.num_output_tokens == 10
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_a_prompt_cap_chunks_prompts_and_never_holds_a_decode_row_back():
    """``prompt_cap`` bounds the prompt tokens (rows computing more than one token) of a
    step within its budget; decode rows still all run, and a prompt that gets no chunk
    waits for the next step (it is not preempted)."""
    s = make(budget=64)
    a = req("a", 5, max_tokens=20)
    s.add(a)
    run_step(s)  # a decodes from now on
    s.prompt_cap = 6
    b, c = req("b", 10), req("c", 9)
    s.add(b)
    s.add(c)
    out, _ = run_step(s)
    assert out.requests == [a, b] and out.num_tokens == [1, 6]  # c: no chunk left
    assert c.status is RequestStatus.WAITING
    out, _ = run_step(s)
    assert out.requests == [a, b, c] and out.num_tokens == [1, 4, 2]
    out, _ = run_step(s)
    assert out.requests == [a, b, c] and out.num_tokens == [1, 1, 6]
    s.prompt_cap = 0  # nothing for prompts: the decode rows alone
    c2 = req("d", 7)
    s.add(c2)
    out, _ = run_step(s)
    assert out.requests == [a, b, c] and out.num_tokens == [1, 1, 1]
    s.prompt_cap = None
    out, _ = run_step(s)
    assert out.requests == [a, b, c, c2] and out.num_tokens == [1, 1, 1, 7]
    while s.has_unfinished:
        run_step(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks
