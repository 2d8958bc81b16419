"""Step costs: learned from the steps an engine runs, published with its load."""

from __future__ import annotations

import pytest

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.engine.step_costs import StepCosts
from pdmesh.shared.runtime.loop import EngineLoop


def test_running_averages_of_decode_steps_and_prompt_tokens():
    c = StepCosts()
    c.record(0.010, prefill_tokens=100, decode_rows=0)  # no decode measured: all of it
    assert c.prefill_ns_per_token == pytest.approx(100_000)
    assert c.decode_step_us == 0
    c.record(0.004, prefill_tokens=0, decode_rows=8)
    assert c.decode_step_us == pytest.approx(4000)
    c.record(0.006, prefill_tokens=0, decode_rows=8)
    assert c.decode_step_us == pytest.approx(0.8 * 4000 + 0.2 * 6000)
    before = c.prefill_ns_per_token
    # a mixed step: what the 200 prompt tokens added over the decode step
    c.record(0.0044 + 0.008, prefill_tokens=200, decode_rows=4)
    assert c.prefill_ns_per_token == pytest.approx(0.8 * before + 0.2 * 40_000)
    c.record(0.001, prefill_tokens=50, decode_rows=4)  # faster than decode: adds nothing
    assert c.prefill_ns_per_token == pytest.approx(0.8 * (0.8 * before + 0.2 * 40_000))
    c.record(0.5, prefill_tokens=0, decode_rows=0)  # an empty step teaches nothing
    assert c.decode_step_us == pytest.approx(4400)


def test_an_engine_measures_its_steps_and_publishes_them(qwen3_path):
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16,
              max_num_batched_tokens=256)
    llm.generate([list(range(10, 310)), list(range(20, 60))],
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    costs = llm.engine.step_costs
    assert costs.decode_step_us > 0 and costs.prefill_ns_per_token > 0
    load = EngineLoop(llm.engine, port=None).load()
    assert load.decode_step_us == round(costs.decode_step_us)
    assert load.prefill_ns_per_token == round(costs.prefill_ns_per_token)
    assert load.max_num_batched_tokens == 256
    assert {"decode_step_us", "prefill_ns_per_token",
            "max_num_batched_tokens"} <= set(load.registry_fields())
