"""The engine loop: many requests through one port, one stepping thread, every request
ending with exactly one finished delta."""

from __future__ import annotations

import threading

import pytest

from pdmesh.shared.engine import LLM, EngineConfig, SamplingParams, build_engine
from pdmesh.shared.runtime.protocol import Status
from tests.shared.runtime.driver import LoopDriver


@pytest.fixture
def loop(qwen3_path):
    driver = LoopDriver(build_engine(EngineConfig(model=str(qwen3_path), device="cpu",
                                                  dtype="float32", block_size=16)))
    yield driver
    driver.stop()


def test_streams_match_offline_and_abort_frees(qwen3_path, loop):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    offline = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)
    expected = offline.generate([[5, 6, 7], list(range(40, 80))], params)
    a = loop.submit([5, 6, 7], params)
    b = loop.submit(list(range(40, 80)), params)
    long = loop.submit([9, 9, 9], SamplingParams(max_tokens=5000, ignore_eos=True))
    assert a.drain()[0] == expected[0].outputs[0].token_ids
    tokens, last = b.drain()
    assert tokens == expected[1].outputs[0].token_ids and last.finish_reason == "length"
    long.get(timeout=30)
    loop.abort(long.request_id)
    _, last = long.drain()
    assert last.finish_reason == "abort"
    kv = loop.engine.kv
    for _ in range(100):
        if kv.num_free_blocks == kv.num_blocks:
            break
        threading.Event().wait(0.05)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_bad_request_ends_with_an_error_naming_the_field(loop):
    bad = SamplingParams()
    bad.top_p = 5.0  # changed after construction: the engine validates again
    for prompt, params, field in (([1, 2], bad, "top_p"), ([], SamplingParams(), "prompt")):
        tokens, last = loop.submit(prompt, params).drain()
        assert tokens == [] and last.error.status is Status.INVALID_ARGUMENT
        assert field in last.error.message
    s = loop.submit([1, 2], SamplingParams(max_tokens=200, ignore_eos=True), request_id="dup")
    s.get(timeout=30)  # running
    dup = loop.submit([1, 2], SamplingParams(), request_id="dup")
    refusal = dup.get(timeout=30)
    while refusal.error is None:  # the running one's deltas share the stream
        refusal = dup.get(timeout=30)
    assert refusal.error.status is Status.INVALID_ARGUMENT
    assert "request_id" in refusal.error.message
    _, last = s.drain()
    assert last.finish_reason == "length"


def test_stopping_fails_every_open_request(qwen3_path):
    driver = LoopDriver(build_engine(EngineConfig(model=str(qwen3_path), device="cpu",
                                                  dtype="float32", block_size=16)))
    s = driver.submit([1, 2, 3], SamplingParams(max_tokens=5000, ignore_eos=True))
    s.get(timeout=30)
    driver.stop()
    _, last = s.drain()
    assert last.error is not None and last.error.status is Status.UNAVAILABLE


def test_the_load_tells_a_stall(qwen3_path):
    """stalled_ms: how long the engine has had work without finishing a step (what the
    heartbeat publishes, so a hung step shows though the heartbeat thread goes on)."""
    import time

    from pdmesh.shared.runtime.loop import EngineLoop, LocalPort

    engine = build_engine(EngineConfig(model=str(qwen3_path), device="cpu", dtype="float32",
                                       block_size=16))
    loop = EngineLoop(engine, LocalPort())
    assert loop.load().stalled_ms == 0  # nothing to do: never stalled
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    loop._progress = time.monotonic() - 12.5  # as if a step had hung that long
    assert 12_000 <= loop.load().stalled_ms < 20_000
    assert loop.load().registry_fields()["stalled_ms"] >= 12_000
    loop._step()  # a step ends: progress again
    assert loop.load().stalled_ms < 1_000


def test_a_signal_after_a_peers_drain_is_the_first():
    """The drain a data-parallel peer passes on (the lockstep's flags) does not make the
    launcher's own SIGTERM, which may arrive just after, a second one that stops at once:
    the requests in flight still finish. A signal after that one stops."""
    from pdmesh.shared.runtime.loop import EngineLoop

    loop = EngineLoop(engine=None, port=None)  # (drain and stop touch neither)
    loop.peer_drain(5.0)
    assert loop.draining and not loop._stopping
    loop.drain(30.0)
    assert loop.draining and not loop._stopping
    loop.drain(30.0)
    assert loop._stopping
    own = EngineLoop(engine=None, port=None)
    own.drain(30.0)
    own.peer_drain(1.0)  # (already draining by its own signal: nothing changes)
    assert own.draining and not own._stopping
    own.drain(30.0)
    assert own._stopping


def test_a_message_put_as_the_local_ports_wait_times_out_is_not_missed():
    """A put that lands between the wait's timeout and its clearing of the wake still
    counts: the waiter (a yielding decode engine, an idle one) steps on at once."""
    from pdmesh.shared.runtime.loop import LocalPort

    port = LocalPort()

    class LateWake(threading.Event):
        def wait(self, timeout=None):  # times out, and the put comes just then
            woken = super().wait(0)
            port.put("late")
            return woken

    port._wake = LateWake()
    assert port.wait(0.01) and port.receive() == ["late"]
    port._wake = threading.Event()
    assert not port.wait(0.01) and port.receive() == []
