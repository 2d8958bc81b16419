"""Step costs: learned from the steps an engine runs, published with its load."""

from __future__ import annotations

import pytest
import torch

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


def test_a_step_budget_sizes_the_prompt_chunks_by_the_costs_measured(qwen3_path):
    """``chunk_step_ms`` (a decode instance's --decode-tpot-slo-ms): a block a step while
    a prompt token's cost is unknown, then what fits beside a decode step, never less
    than a block nor more than max_num_batched_tokens; the engine's load publishes it,
    and the steps keep to it."""
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16,
              max_num_batched_tokens=256)
    engine = llm.engine
    assert engine.prompt_chunk_tokens() == 256  # no budget: the step's
    engine.chunk_step_ms = 20.0
    assert engine.prompt_chunk_tokens() == 16  # nothing measured yet (MIN_PROMPT_CHUNK)
    engine.step_costs.decode_step_us, engine.step_costs.prefill_ns_per_token = 4000, 100_000
    assert engine.prompt_chunk_tokens() == 160  # (20 - 4) ms / 0.1 ms
    assert EngineLoop(engine, port=None).load().max_num_batched_tokens == 160
    engine.step_costs.prefill_ns_per_token = 10_000
    assert engine.prompt_chunk_tokens() == 256
    engine.step_costs.decode_step_us = 30_000  # decode alone is over the budget
    assert engine.prompt_chunk_tokens() == 16
    engine.step_costs.decode_step_us, engine.step_costs.prefill_ns_per_token = 4000, 200_000
    from pdmesh.shared.engine.step_hooks import StepHook

    class Seen(StepHook):
        def updated(self, step) -> None:
            chunks.append((step.prompt_tokens, engine.scheduler.prompt_cap))

    chunks: list[tuple[int, int]] = []
    engine.hooks.append(Seen())
    llm.generate([list(range(10, 310))], SamplingParams(temperature=0, max_tokens=2,
                                                        ignore_eos=True))
    prompt = [(n, cap) for n, cap in chunks if n > 1]
    assert all(16 <= n <= cap <= 256 for n, cap in prompt[:-1]), chunks
    assert len(prompt) >= 3 and sum(n for n, _ in chunks) >= 299, chunks


def test_costs_measured_before_serving_leave_nothing_behind(qwen3_path):
    """``measure_step_costs``: both costs known before the first request; the prefix
    cache, the counters, the step hooks and a time budget as they were."""
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16,
              max_num_batched_tokens=256)
    engine = llm.engine
    engine.chunk_step_ms = 5.0
    hooks = list(engine.hooks)
    engine.measure_step_costs()
    costs = engine.step_costs
    assert costs.decode_step_us > 0 and costs.prefill_ns_per_token > 0
    assert engine.hooks == hooks and engine.chunk_step_ms == 5.0
    assert not engine.has_unfinished() and engine.scheduler.prefix_queries == 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    prompt = torch.randint(4096, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    req = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    engine.step()
    assert req.num_cached_tokens == 0  # the same prompt again: no prefix hit left over
    small = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16,
                num_kv_blocks=3).engine  # 48 tokens of cache: a shorter prompt
    small.measure_step_costs()
    assert small.step_costs.prefill_ns_per_token > 0
    assert small.kv.num_free_blocks == small.kv.num_blocks
