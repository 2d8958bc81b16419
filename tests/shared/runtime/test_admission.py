"""Admission control in the engine loop: with max_queued_requests, a request arriving
while that many wait (not yet running) is refused at submission; admitted ones finish."""

from __future__ import annotations

import threading

import pytest

from pdmesh.shared.engine import EngineConfig, EngineCore, SamplingParams
from pdmesh.shared.runtime.loop import EngineLoop, QueueFull


@pytest.fixture
def engine(qwen3_path):
    return EngineCore(EngineConfig(model=str(qwen3_path), device="cpu", dtype="float32",
                                   block_size=16, max_num_seqs=1, max_queued_requests=2))


def drain(stream):
    tokens, last = [], None
    while last is None or not last.finished:
        last = stream.get(timeout=30)
        tokens += last.token_ids
    return tokens, last


def test_waiting_requests_beyond_the_limit_are_refused(engine):
    loop = EngineLoop(engine)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a = loop.submit([5, 6, 7], params)
    b = loop.submit([8, 9], params)
    with pytest.raises(QueueFull, match="max_queued_requests: 2") as info:
        loop.submit([1, 2], params)  # the loop has not started: both still wait
    assert info.value.limit == 2 and not isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match="request_id"):  # a bad request is still a ValueError
        loop.submit([1], params, request_id=a.request_id)
    t = threading.Thread(target=loop.run, daemon=True)
    t.start()
    try:
        assert [len(drain(s)[0]) for s in (a, b)] == [4, 4]  # the admitted ones finish
        # a running request holds its seat and does not count as waiting
        busy = loop.submit([3, 4], SamplingParams(max_tokens=500, ignore_eos=True))
        busy.get(timeout=30)  # its first token: it runs, alone (max_num_seqs 1)
        waiting = [loop.submit([20 + i], params) for i in range(2)]
        with pytest.raises(QueueFull):
            loop.submit([30], params)
        loop.abort(busy.request_id)
        assert drain(busy)[1].finish_reason == "abort"
        assert [drain(s)[1].finish_reason for s in waiting] == ["length", "length"]
        assert len(drain(loop.submit([40], params))[0]) == 4  # room again
    finally:
        loop.stop()
        t.join(10)


def test_no_limit_by_default(qwen3_path):
    loop = EngineLoop(EngineCore(EngineConfig(model=str(qwen3_path), device="cpu",
                                              dtype="float32", block_size=16)))
    for i in range(50):  # nothing runs: all fifty wait, none is refused
        loop.submit([1 + i], SamplingParams(max_tokens=1))
    assert len(loop._streams) == 50
