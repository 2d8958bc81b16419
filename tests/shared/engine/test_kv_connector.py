"""Prefill and decode engines handing KV over through a pool: the output equals one
engine doing everything, and the pool doubles as a cross-instance prefix cache."""

from __future__ import annotations

import time

import pytest
import torch

from pdmesh.shared.engine import LLM, EngineConfig, EngineCore, SamplingParams, build_engine
from pdmesh.shared.kvpool import InProcessPool, KVPool
from pdmesh.shared.kvpool.mooncake import MooncakePool

NEW = 12
_g = torch.Generator().manual_seed(77)
SHARED = torch.randint(10, 4000, (40,), generator=_g).tolist()
PROMPTS = [
    SHARED + torch.randint(10, 4000, (7,), generator=_g).tolist(),  # 47: a partial tail
    torch.randint(10, 4000, (32,), generator=_g).tolist(),  # exactly two blocks
    SHARED + torch.randint(10, 4000, (20,), generator=_g).tolist(),
    [5, 6, 7],
]


def engine(path, pool: KVPool | None, producer: bool) -> EngineCore:
    return build_engine(EngineConfig(model=str(path), device="cpu", dtype="float32",
                                     block_size=16), kv_pool=pool, save_prompts=producer)


def run(eng: EngineCore, reqs: list) -> None:
    while eng.has_unfinished():
        eng.step()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    del reqs


@pytest.fixture(scope="module")
def expected(qwen3_path):
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def disaggregated(qwen3_path, pool: KVPool) -> tuple[list[list[int]], list]:
    prefill, decode = engine(qwen3_path, pool, True), engine(qwen3_path, pool, False)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    pre = [prefill.add_request(p, first) for p in PROMPTS]
    run(prefill, pre)
    assert all(r.kv_keys for r in pre)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    dec = [decode.add_request(p, params, output_token_ids=r.output_token_ids)
           for p, r in zip(PROMPTS, pre, strict=True)]
    run(decode, dec)
    return [r.output_token_ids for r in dec], dec


def test_prefill_then_decode_through_the_pool(qwen3_path, expected):
    pool = InProcessPool()
    got, dec = disaggregated(qwen3_path, pool)
    assert got == expected
    # decode computed nothing of the prompts: every prompt token came from the pool
    assert [r.num_cached_tokens for r in dec] == [len(p) for p in PROMPTS]


def test_pool_is_a_cross_instance_prefix_cache(qwen3_path):
    pool = InProcessPool()
    a = engine(qwen3_path, pool, True)
    first = SamplingParams(temperature=0, max_tokens=1)
    r0 = a.add_request(PROMPTS[0], first)
    run(a, [r0])
    b = engine(qwen3_path, pool, True)  # another prefill instance, cold local cache
    r2 = b.add_request(PROMPTS[2], first)
    run(b, [r2])
    assert r2.num_cached_tokens == 32  # the two full blocks of the shared 40-token prefix


class FlakyPool(InProcessPool):
    """Says it has everything it was given, then loses it before the load."""

    def get(self, keys, regions):
        return [False] * len(keys)


def test_blocks_vanishing_before_load_are_recomputed(qwen3_path, expected):
    pool = FlakyPool()
    got, dec = disaggregated(qwen3_path, pool)
    assert got == expected
    # and the decode engine's own prefix cache was not left pointing at unfilled blocks
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    eng = engine(qwen3_path, None, False)
    again = eng.add_request(PROMPTS[0], params)
    run(eng, [again])
    assert again.output_token_ids == expected[0]


def test_prefill_then_decode_through_mooncake(qwen3_path, expected, mooncake_master):
    """And the decode instance puts what it finished (vLLM-Ascend's consumer_is_to_put):
    the conversation's next turn, prompt and answer and more, finds the answer's blocks
    too, where the prefill instance's own put ends with the prompt."""
    master = mooncake_master
    pools = [MooncakePool(master.ports.master_address, master.ports.metadata_url,
                          segment_bytes=64 << 20, local_buffer_bytes=16 << 20) for _ in range(2)]
    try:
        prefill = engine(qwen3_path, pools[0], True)
        decode = build_engine(EngineConfig(model=str(qwen3_path), device="cpu",
                                           dtype="float32", block_size=16,
                                           kv_put_finished=True), kv_pool=pools[1])
        first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        pre = [prefill.add_request(p, first) for p in PROMPTS]
        run(prefill, pre)
        params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
        dec = [decode.add_request(p, params, output_token_ids=r.output_token_ids)
               for p, r in zip(PROMPTS, pre, strict=True)]
        run(decode, dec)
        assert [r.output_token_ids for r in dec] == expected
        assert [r.num_cached_tokens for r in dec] == [len(p) for p in PROMPTS]
        # PROMPTS[2] (60 tokens) and its 12: 71 tokens of KV, 4 whole blocks; the prompt
        # alone fills 3
        turn = PROMPTS[2] + dec[2].output_token_ids + [9, 8, 7, 6, 5]
        want = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16).generate(
            [turn], params)[0].outputs[0].token_ids
        again = engine(qwen3_path, pools[0], False)  # (a fresh instance: an empty cache)
        nxt = again.add_request(turn, params)
        run(again, [nxt])
        assert nxt.num_cached_tokens == 64 and nxt.output_token_ids == want
    finally:
        for p in pools:
            p.close()


class GatedPool(InProcessPool):
    """The in-process pool whose reads wait until the test opens the gate (a slow pool
    read, made deterministic); ``fail`` makes them come back empty."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.gate = threading.Event()
        self.fail = False
        self.reads = 0

    def get(self, keys, regions):
        self.reads += 1
        assert self.gate.wait(30), "the test never opened the gate"
        return [False] * len(keys) if self.fail else super().get(keys, regions)


def test_decode_steps_never_wait_for_a_pool_read(qwen3_path, expected):
    """A decode engine's pool read runs beside its steps: while one request's blocks are
    on their way, the running requests keep producing tokens; it joins once they are in
    and ends with the same tokens; an abort while loading or a failed load leaks nothing
    (a failed load is computed here instead)."""
    pool = GatedPool()
    prefill, decode = engine(qwen3_path, pool, True), engine(qwen3_path, pool, False)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    pre = [prefill.add_request(p, first) for p in PROMPTS]
    run(prefill, pre)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    pool.gate.set()
    a = decode.add_request(PROMPTS[0], params, output_token_ids=pre[0].output_token_ids)
    while not a.output_token_ids[1:]:  # a runs
        decode.step()
    pool.gate.clear()
    b = decode.add_request(PROMPTS[2], params, output_token_ids=pre[2].output_token_ids)
    before = len(a.output_token_ids)
    for _ in range(3):  # b's read is held: a keeps decoding, b is not in the batch
        outs = decode.step()
        assert [o.request for o in outs] == [a]
    assert len(a.output_token_ids) == before + 3 and b.num_computed_tokens < len(PROMPTS[2])
    deadline = time.monotonic() + 10  # (the read starts on a helper thread)
    while pool.reads < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.reads == 2 and decode.scheduler.loading
    pool.gate.set()
    run(decode, [a, b])
    assert a.output_token_ids == expected[0] and b.output_token_ids == expected[2]
    assert b.kv_get_bytes > 0 and b.num_cached_tokens >= 32  # it loaded, not computed
    # aborted while its read is held: its blocks go back once the read is done
    pool.gate.clear()
    c = decode.add_request(PROMPTS[1], params, output_token_ids=pre[1].output_token_ids)
    decode.step()
    assert decode.scheduler.loading
    decode.abort(c.request_id)
    pool.gate.set()
    run(decode, [c])  # (checks that every block is free again)
    assert c.is_finished and not decode.scheduler.loading
    # a failed read: the prompt is computed here, with the same result
    pool.fail = True
    d = decode.add_request(PROMPTS[1], params, output_token_ids=pre[1].output_token_ids)
    run(decode, [d])
    assert d.output_token_ids == expected[1]


def test_a_pool_read_past_its_timeout_is_given_up(qwen3_path, expected):
    """A read that hangs (a peer stopped answering) is given up after the timeout: the
    request computes its prompt here in other blocks, while the blocks the read may
    still write stay out of use until it ends; nothing leaks, the text is the same."""
    pool = GatedPool()
    config = EngineConfig(model=str(qwen3_path), device="cpu", dtype="float32",
                          block_size=16, kv_load_timeout_s=0.3)
    prefill = engine(qwen3_path, pool, True)
    decode = build_engine(config, kv_pool=pool, save_prompts=False)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    pre = [prefill.add_request(p, first) for p in PROMPTS[:3]]
    run(prefill, pre)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    b = decode.add_request(PROMPTS[2], params, output_token_ids=pre[2].output_token_ids)
    decode.step()
    deadline = time.monotonic() + 10  # (the read starts on a helper thread)
    while pool.reads < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert decode.scheduler.loading and pool.reads == 1
    deadline = time.monotonic() + 10
    while decode.scheduler.kv_load_timeouts == 0:
        assert time.monotonic() < deadline
        decode.step()
    assert not decode.scheduler.loading and b.pool_gave_up
    while len(b.output_token_ids) < 4:  # it computes its prompt and decodes meanwhile
        decode.step()
    held = decode.kv.num_blocks - decode.kv.num_free_blocks
    assert held > decode.kv.blocks_for(b.num_tokens)  # the read's blocks, still held
    pool.gate.set()  # the read ends, writing into the blocks nobody uses
    # aborted after its read was given up: nothing leaks either
    pool.gate.clear()
    c = decode.add_request(PROMPTS[1], params, output_token_ids=pre[1].output_token_ids)
    while decode.scheduler.kv_load_timeouts < 2:
        decode.step()
    decode.abort(c.request_id)
    pool.gate.set()
    while decode.has_unfinished():
        decode.step()
    time.sleep(0.2)  # the given-up reads end; their blocks come back at the next step
    decode.step()
    assert decode.kv.num_free_blocks == decode.kv.num_blocks
    assert b.output_token_ids == expected[2] and b.num_cached_tokens == 0  # computed
    assert c.is_finished and pool.reads == 2


class GatedPutPool(InProcessPool):
    """The in-process pool whose puts wait until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.gate = threading.Event()
        self.puts_started = threading.Event()
        self.puts_done = 0

    def put(self, keys, regions):
        self.puts_started.set()
        assert self.gate.wait(30), "the test never opened the gate"
        stored = super().put(keys, regions)
        self.puts_done += 1
        return stored


def test_a_prefill_instance_sends_the_first_token_before_the_prompts_put(qwen3_path):
    """The first token leaves the engine loop while the prompt's put is still under way;
    the request ends with its keys once the put is done, and its blocks (pinned for the
    put after the request ended) all go back; a request aborted meanwhile leaks none."""
    from tests.shared.runtime.driver import LoopDriver

    pool = GatedPutPool()
    loop = LoopDriver(engine(qwen3_path, pool, True))
    try:
        first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        s = loop.submit(PROMPTS[1], first)  # two full blocks: the token needs a third
        head = s.get()
        assert head.token_ids and not head.finished and not head.kv_keys
        assert pool.puts_started.wait(30) and not pool.puts_done  # the put waits
        aborted = loop.submit(PROMPTS[0], first)  # queued behind the put
        loop.abort(aborted.request_id)
        pool.gate.set()
        tokens, last = s.drain()
        assert tokens == [] and last.finish_reason == "length" and len(last.kv_keys) == 2
        assert all(pool.exists(last.kv_keys))
        assert aborted.drain()[1].finish_reason == "abort"
        kv = loop.engine.kv
        for _ in range(200):
            if kv.num_free_blocks == kv.num_blocks and not loop.engine.has_unfinished():
                break
            time.sleep(0.05)
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        pool.gate.set()
        loop.stop()


def test_dyntralb_prefetch_reads_kv_without_seats_and_the_plan_admits_it(qwen3_path,
                                                                        expected):
    """vLLM-Ascend's DyntraLB prefetch on a decode engine: pool reads start for up to
    ``limit`` fresh waiting requests (past it: not candidates this step; nothing to
    read: a candidate as it is); their KV in, they wait in ``ready`` without seats; a
    plan admits the size it names; every answer equals one engine's, and an aborted
    prefetched request gives its blocks back."""
    from pdmesh.shared.engine.dyntralb import RankMoves
    from pdmesh.shared.engine.request import RequestStatus

    pool = InProcessPool()
    prefill, decode = engine(qwen3_path, pool, True), engine(qwen3_path, pool, False)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    pre = [prefill.add_request(p, first) for p in PROMPTS]
    run(prefill, pre)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    order = [3, 1, 0]  # 4 tokens (1 block), 33 (3 blocks), 48 (3 blocks)
    tiny, two, three = (decode.add_request(PROMPTS[i], params,
                                           output_token_ids=pre[i].output_token_ids)
                        for i in order)
    s = decode.scheduler
    s.prefetch_kv(1)
    assert list(s.loading.values())[0][0] is tiny
    assert s.lb_candidates() == []  # tiny is loading, the rest past the limit
    s.prefetch_kv(3)
    assert len(s.loading) == 3 and s._seats_taken == 0
    deadline = time.monotonic() + 30
    while len(s.ready) < 3 and time.monotonic() < deadline:
        s._finish_loads()
        time.sleep(0.005)
    assert s.ready == [tiny, two, three] and not s.running
    assert two.num_computed_tokens == 32 and three.num_computed_tokens == 47
    s.lb_snapshot = s.lb_candidates()
    assert s.lb_snapshot == [tiny, two, three]
    s.set_lb_plan(RankMoves([], [3]))  # the first candidate of 3 blocks: past tiny
    decode.step()
    assert s.running == [two] and s.ready == [tiny, three]
    decode.abort(tiny.request_id)
    assert tiny.status is RequestStatus.FINISHED_ABORTED and s.ready == [three]
    s.set_lb_plan(None)
    while decode.has_unfinished():
        decode.step()
    assert [two.output_token_ids, three.output_token_ids] == [expected[1], expected[0]]
    assert decode.kv.num_free_blocks == decode.kv.num_blocks
