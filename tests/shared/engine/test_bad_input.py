"""Bad input raises ValueError naming the field; the engine keeps working and leaks no
KV block."""

from __future__ import annotations

import pytest

from pdmesh.shared.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(qwen3_path):
    return LLM(str(qwen3_path), device="cpu", block_size=16, max_model_len=64, num_kv_blocks=32)


def full(llm: LLM) -> bool:
    return llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize(("prompt", "params", "field"), [
    (list(range(1, 80)), SamplingParams(), "prompt"),  # longer than max_model_len
    ([], SamplingParams(), "prompt"),
    ([1, 2, 99999], SamplingParams(), "prompt_token_ids"),
    ([1, 2, -3], SamplingParams(), "prompt_token_ids"),
    ([1, 2, 3], SamplingParams(stop_token_ids=[10 ** 6]), "stop_token_ids"),
])
def test_bad_prompts(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([[5, 6, 7], prompt], params)  # a good prompt beside it does not run
    assert full(llm)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"logprobs": 100}, "logprobs"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_request_that_cannot_fit_the_cache_is_refused(qwen3_path):
    small = LLM(str(qwen3_path), device="cpu", block_size=16, num_kv_blocks=2)
    with pytest.raises(ValueError, match="max_tokens"):
        small.generate([[1] * 20], SamplingParams(max_tokens=40))
    assert full(small)


def test_bad_prompt_types(llm):
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([])
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        llm.generate(["ok", 3.5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_engine_still_serves_after_errors(llm):
    out = llm.generate(["def f(x):", [5, 6, 7]], SamplingParams(temperature=0, max_tokens=8))
    assert all(len(o.outputs[0].token_ids) >= 1 for o in out)
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in out)
    assert full(llm)


def test_bad_engine_config(qwen3_path):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(qwen3_path), device="cpu", max_model_len=10 ** 6)
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(qwen3_path), device="cpu", block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(qwen3_path), device="cpu", dtype="float8")
    with pytest.raises(ValueError, match="device"):
        LLM(str(qwen3_path), device="tpu")


def test_failed_step_leaks_nothing_and_poisons_no_cache(qwen3_path, monkeypatch):
    llm = LLM(str(qwen3_path), device="cpu", block_size=16)
    prompts = [list(range(100, 150)), list(range(100, 140))]  # a shared 32-token prefix
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.engine.kv.reset_prefix_cache()
    runner = llm.engine.runner
    real = runner.execute

    def fail_once(step, **_):
        runner.execute = real
        raise RuntimeError("device lost")

    monkeypatch.setattr(runner, "execute", fail_once)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(prompts, params)
    assert full(llm) and not llm.engine.has_unfinished()
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert again == expected
