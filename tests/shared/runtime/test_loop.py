"""The engine loop: many callers, one stepping thread, one stream per request."""

from __future__ import annotations

import threading

import pytest

from pdmesh.shared.engine import LLM, EngineConfig, EngineCore, SamplingParams
from pdmesh.shared.runtime.loop import EngineLoop


@pytest.fixture
def loop(qwen3_path):
    lp = EngineLoop(EngineCore(EngineConfig(model=str(qwen3_path), device="cpu",
                                            dtype="float32", block_size=16)))
    t = threading.Thread(target=lp.run, daemon=True)
    t.start()
    yield lp
    lp.stop()
    t.join(10)


def drain(stream):
    tokens, last = [], None
    while last is None or not last.finished:
        last = stream.get(timeout=30)
        tokens += last.token_ids
    return tokens, last


def test_streams_match_offline_and_abort_frees(qwen3_path, loop):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    offline = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)
    expected = offline.generate([[5, 6, 7], list(range(40, 80))], params)
    a = loop.submit([5, 6, 7], params)
    b = loop.submit(list(range(40, 80)), params)
    long = loop.submit([9, 9, 9], SamplingParams(max_tokens=5000, ignore_eos=True))
    assert drain(a)[0] == expected[0].outputs[0].token_ids
    tokens, last = drain(b)
    assert tokens == expected[1].outputs[0].token_ids and last.finish_reason == "length"
    long.get(timeout=30)
    loop.abort(long.request_id)
    _, last = drain(long)
    assert last.finish_reason == "abort"
    kv = loop.engine.kv
    for _ in range(100):
        if kv.num_free_blocks == kv.num_blocks:
            break
        threading.Event().wait(0.05)
    assert kv.num_free_blocks == kv.num_blocks


def test_bad_request_raises_in_the_caller(loop):
    bad = SamplingParams()
    bad.top_p = 5.0  # changed after construction: submit validates again
    with pytest.raises(ValueError, match="top_p"):
        loop.submit([1, 2], bad)
    with pytest.raises(ValueError, match="prompt"):
        loop.submit([], SamplingParams())
    s = loop.submit([1, 2], SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(ValueError, match="request_id"):
        loop.submit([1, 2], SamplingParams(), request_id="dup")
    assert drain(s)[1].finished
