"""Admission control in the engine loop: with max_queued_requests, a request arriving
while that many wait (not yet running) is refused (RESOURCE_EXHAUSTED); admitted ones
finish."""

from __future__ import annotations

import pytest

from pdmesh.shared.engine import EngineConfig, SamplingParams, build_engine
from pdmesh.shared.runtime.protocol import Status
from tests.shared.runtime.driver import LoopDriver


@pytest.fixture
def engine(qwen3_path):
    return build_engine(EngineConfig(model=str(qwen3_path), device="cpu", dtype="float32",
                                     block_size=16, max_num_seqs=1, max_queued_requests=2))


def refusal(stream):
    tokens, last = stream.drain()
    assert tokens == [] and last.error is not None
    return last.error


def test_waiting_requests_beyond_the_limit_are_refused(engine):
    loop = LoopDriver(engine, start=False)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a = loop.submit([5, 6, 7], params)
    b = loop.submit([8, 9], params)
    third = loop.submit([1, 2], params)  # admitted in order, before any step: a, b wait
    loop.start()
    try:
        error = refusal(third)
        assert error.status is Status.RESOURCE_EXHAUSTED
        assert "max_queued_requests: 2" in error.message
        assert [len(s.drain()[0]) for s in (a, b)] == [4, 4]  # the admitted ones finish
        # a running request holds its seat and does not count as waiting
        busy = loop.submit([3, 4], SamplingParams(max_tokens=500, ignore_eos=True))
        busy.get(timeout=30)  # its first token: it runs, alone (max_num_seqs 1)
        waiting = [loop.submit([20 + i], params) for i in range(2)]
        assert refusal(loop.submit([30], params)).status is Status.RESOURCE_EXHAUSTED
        loop.abort(busy.request_id)
        assert busy.drain()[1].finish_reason == "abort"
        assert [s.drain()[1].finish_reason for s in waiting] == ["length", "length"]
        assert len(loop.submit([40], params).drain()[0]) == 4  # room again
    finally:
        loop.stop()


def test_no_limit_by_default(qwen3_path):
    loop = LoopDriver(build_engine(EngineConfig(model=str(qwen3_path), device="cpu",
                                                dtype="float32", block_size=16)), start=False)
    streams = [loop.submit([1 + i], SamplingParams(max_tokens=1)) for i in range(50)]
    loop.start()  # all fifty arrive together, before any step: none is refused
    try:
        assert [s.drain()[1].finish_reason for s in streams] == ["length"] * 50
    finally:
        loop.stop()


def test_a_priority_the_engine_does_not_use_is_refused_when_asked(qwen3_path):
    """--abort-on-priority-when-disabled: a request that gives a priority to an engine
    that does not schedule by it is refused naming the field; one without runs."""
    loop = LoopDriver(build_engine(EngineConfig(model=str(qwen3_path), device="cpu",
                                                dtype="float32", block_size=16,
                                                abort_on_priority_when_disabled=True)))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    try:
        error = refusal(loop.submit([5, 6, 7], params, priority=1))
        assert error.status is Status.INVALID_ARGUMENT
        assert error.message.startswith("priority: this engine does not schedule by")
        assert len(loop.submit([5, 6, 7], params).drain()[0]) == 3
    finally:
        loop.stop()
