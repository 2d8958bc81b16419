"""The periodic stats line: vLLM's every interval that saw work (and once as the engine
goes idle), SGLang's every --decode-log-interval decoding steps; what serving turns on."""

from __future__ import annotations

import logging

import pytest

from pdmesh.shared.config.serve import serve_config
from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.engine.stats_log import StatsLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pdmesh.engine.stats"]


def test_vllm_s_line_every_interval_with_work(qwen3_path, caplog):
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)
    engine = llm.engine
    clock = Clock()
    stats = StatsLog(engine.scheduler, engine.kv, interval_s=10.0, clock=clock)
    engine.hooks.append(stats)
    caplog.set_level(logging.INFO, logger="pdmesh.engine.stats")
    engine.add_request(list(range(10, 42)), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()  # the prompt (32 tokens) and its first token
    clock.now = 4.0
    assert lines(caplog) == []
    engine.step()
    clock.now = 10.0
    engine.step()  # due: 32 prompt tokens and 3 generated in 10 s, one running
    [line] = lines(caplog)
    assert line.startswith("Avg prompt throughput: 3.2 tokens/s, Avg generation "
                           "throughput: 0.3 tokens/s, Running: 1 reqs, Waiting: 0 reqs"), line
    while engine.has_unfinished():
        engine.step()
    clock.now = 20.0
    stats.idle()  # the interval the work ended in, showing it idle; then no more
    clock.now = 30.0
    stats.idle()
    got = lines(caplog)
    assert len(got) == 2 and got[1].startswith(
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.2 tokens/s, "
        "Running: 0 reqs"), got


def test_sglang_s_line_every_n_decoding_steps(qwen3_path, caplog):
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16,
              decode_log_interval=3)
    caplog.set_level(logging.INFO, logger="pdmesh.engine.stats")
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, ignore_eos=True))
    # the prompt's step samples its first token; 7 decoding steps: two lines
    got = lines(caplog)
    assert len(got) == 2, got
    assert got[0].startswith("Decode batch. #running-req: 1, #token: ") and \
        got[0].endswith("#queue-req: 0")


@pytest.mark.parametrize(("words", "interval", "every"), [
    ((), 10.0, 0),
    (("--disable-log-stats",), 0.0, 0),
    (("--decode-log-interval", "40"), 0.0, 40),
])
def test_serving_turns_the_line_on(words, interval, every):
    engine = serve_config("config check", ["--role", "mixed", "--model", "/tmp/m",
                                           "--device", "cpu", *words]).engine
    assert (engine.log_stats_interval_s, engine.decode_log_interval) == (interval, every)
