"""Tensor parallelism inside one engine: two rank processes (gloo on loopback), each
with its slice of every layer read straight from the safetensors, compute what one
process computes: the logits within float32 rounding at every step, the greedy output
the same."""

from __future__ import annotations

import pytest
import torch

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.models.config import ModelConfig
from pdmesh.shared.parallel.tensor_parallel import Shard, local_config

PROMPTS = [list(range(40, 75)), [5, 9, 200, 14], list(range(300, 345)), [77] * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(llm: LLM) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The logits the engine sampled from at every step, and the outputs."""
    with llm.engine.runner.logits_kept() as kept:
        outs = llm.generate(PROMPTS, GREEDY)
    return kept, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe", "deepseek_v3"])
def test_two_ranks_compute_what_one_computes(tiny_models, arch):
    path = str(tiny_models[arch])
    want_logits, want = run(LLM(path, device="cpu", dtype="float32", block_size=16))
    tp = LLM(path, device="cpu", dtype="float32", block_size=16, tensor_parallel_size=2)
    try:
        model = tp.engine.model
        full = ModelConfig.from_folder(path)
        # rank 0 holds its half of the heads, the MLP and the vocabulary
        assert model.config.num_heads == full.num_heads // 2
        assert model.w.embed.shape[0] == -(-full.vocab_size // 2)
        got_logits, got = run(tp)
    finally:
        tp.close()
    assert got == want
    assert len(got_logits) == len(want_logits)
    for a, b in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_shards_are_named_when_they_do_not_divide(tiny_models):
    cfg = ModelConfig.from_folder(tiny_models["qwen3"])
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 3 does not divide "
                                         r"num_attention_heads \(8\)"):
        local_config(cfg, Shard(0, 3))
    # more ranks than K / V heads: each rank reads the one its query heads use
    local = local_config(cfg, Shard(3, 4))
    assert (local.num_heads, local.num_kv_heads) == (2, 1)
    assert Shard(3, 4).kv_heads(2) == slice(1, 2)
    with pytest.raises(ValueError, match=r"DeepSeek-V4 does not run tensor-parallel"):
        local_config(ModelConfig.from_folder(tiny_models["deepseek_v4"]), Shard(0, 2))


def test_tensor_parallel_beside_what_it_does_not_take_yet_is_refused(tiny_models):
    with pytest.raises(ValueError, match=r"tensor_parallel_size: not yet with data or "
                                         r"expert parallelism or speculative decoding"):
        LLM(str(tiny_models["qwen3"]), device="cpu", tensor_parallel_size=2,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
