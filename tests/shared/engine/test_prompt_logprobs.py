"""prompt_logprobs in the engine: every prompt token but the first gets the logprob a
direct forward pass of the model gives it (transformers' log_softmax at the position
before it), its rank and the top-n, whole or in chunks, after a preemption mid-prompt,
and with the prompt already in the prefix cache (such a prompt takes no hits)."""

from __future__ import annotations

import pytest

from pdmesh.shared.engine import LLM, SamplingParams
from tests.shared.engine.hf_reference import assert_like_reference, hf_prompt_logprobs

PROMPTS = [list(range(100 + 50 * i, 170 + 50 * i)) for i in range(3)]


@pytest.fixture(scope="module")
def references(qwen3_path):
    return [hf_prompt_logprobs(qwen3_path, p) for p in PROMPTS]


@pytest.mark.parametrize("variant", [
    {},  # each prompt in one step
    {"max_num_batched_tokens": 24},  # in chunks
    # 12 blocks cannot hold three 70-token prompts and their outputs: preempted mid-prompt
    {"max_num_batched_tokens": 24, "num_kv_blocks": 12},
])
def test_prompt_logprobs_equal_a_direct_forward_pass(qwen3_path, references, variant):
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16, **variant)
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, prompt_logprobs=n)
              for n in (2, 0, 5)]
    outs = llm.generate(PROMPTS, params)
    for out, prompt, ref, p in zip(outs, PROMPTS, references, params, strict=True):
        assert_like_reference(out.prompt_logprobs, prompt, ref, p.prompt_logprobs)
    if "num_kv_blocks" in variant:
        assert llm.engine.scheduler.preemptions > 0
    plain = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=32,
                                                     ignore_eos=True))[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == outs[0].outputs[0].token_ids  # sampling unchanged


def test_a_cached_prompt_is_computed_whole_for_its_logprobs(qwen3_path, references):
    """The prompt in the prefix cache: a request without prompt_logprobs takes its hits,
    one with them takes none and scores every token."""
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)
    plain = SamplingParams(temperature=0, max_tokens=4)
    llm.generate(PROMPTS[:1], plain)
    assert llm.generate(PROMPTS[:1], plain)[0].num_cached_tokens == 64
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4,
                                                   prompt_logprobs=1))[0]
    assert out.num_cached_tokens == 0
    assert_like_reference(out.prompt_logprobs, PROMPTS[0], references[0], 1)


def test_a_one_token_prompt_has_one_empty_entry(qwen3_path):
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)
    out = llm.generate([[42]], SamplingParams(max_tokens=2, prompt_logprobs=3))[0]
    assert out.prompt_logprobs == [None]


def test_prompt_logprobs_are_bounded_as_logprobs_are():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
