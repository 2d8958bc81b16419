"""Greedy float32 output identical to Hugging Face transformers, for every architecture,
with prefix caching on and off, with chunked prefill forced, and with preemption forced."""

from __future__ import annotations

import pytest
import torch

from pdmesh.shared.engine import LLM, SamplingParams
from tests.shared.engine.hf_reference import hf_greedy

NEW_TOKENS = 32
# Different lengths; two share a 40-token prefix so prefix caching has something to hit.
_g = torch.Generator().manual_seed(1234)
_base = torch.randint(10, 4000, (40,), generator=_g).tolist()
PROMPTS = [
    torch.randint(10, 4000, (3,), generator=_g).tolist(),
    _base + torch.randint(10, 4000, (9,), generator=_g).tolist(),
    torch.randint(10, 4000, (77,), generator=_g).tolist(),
    _base + torch.randint(10, 4000, (25,), generator=_g).tolist(),
    torch.randint(10, 4000, (130,), generator=_g).tolist(),
]

VARIANTS = {
    "default": {},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "chunked_prefill": {"max_num_batched_tokens": 24},
    # 12 blocks of 16 tokens cannot hold 5 sequences of up to 162 tokens at once
    "preemption": {"num_kv_blocks": 12},
}


# (DeepSeek-V4's reference is fed token by token: tests/shared/models/test_deepseek_v4.py)
ARCHS = ["llama", "qwen3", "qwen3_moe", "deepseek_v3"]


@pytest.fixture(scope="module")
def references(tiny_models):
    return {arch: hf_greedy(tiny_models[arch], PROMPTS, NEW_TOKENS) for arch in ARCHS}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_models, references, arch, variant):
    llm = LLM(str(tiny_models[arch]), device="cpu", dtype="float32", block_size=16,
              **VARIANTS[variant])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # run twice: the second pass sees a warm prefix cache (when it is on)
    for _ in range(2):
        outs = llm.generate(PROMPTS, params)
        got = [o.outputs[0].token_ids for o in outs]
        for i, (g, r) in enumerate(zip(got, references[arch], strict=True)):
            assert g == r, f"prompt {i} (len {len(PROMPTS[i])}) diverged at " \
                           f"{next(j for j in range(len(r)) if g[j] != r[j])}"
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    if variant == "preemption":
        assert llm.engine.scheduler.preemptions > 0
    if variant == "default":
        assert sum(o.num_cached_tokens for o in outs) > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_the_npu_backend_over_the_standin_matches_transformers(tiny_models, references,
                                                               monkeypatch, arch):
    """The same, the engine on the npu backend with its torch_npu the CPU stand-in
    (tests/shared/kernels/npu_standin.py): its own ops (norms, rotary, SwiGLU, MoE gating
    and grouped matmuls) where a layer reaches them (its attention: test_standin_
    parity.py)."""
    import pdmesh.shared.engine.build as engine_build
    from tests.shared.kernels.npu_standin import CALLED, npu_backend

    backend = npu_backend()
    monkeypatch.setattr(engine_build, "get_backend", lambda device: backend)
    CALLED.clear()
    llm = LLM(str(tiny_models[arch]), device="cpu", dtype="float32", block_size=16)
    assert llm.engine.backend is backend
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == references[arch]
    assert {"npu_rms_norm", "npu_add_rms_norm", "npu_swiglu", "npu_grouped_matmul"} <= \
        set(CALLED)
