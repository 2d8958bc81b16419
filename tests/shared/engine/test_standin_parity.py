"""The engine on the device backends over their CPU stand-ins: the npu backend's
attention through FIA and the paged caches (its torch_npu: tests/shared/kernels/
npu_standin.py; its greedy tokens against transformers: test_parity_hf.py) and the cuda
backend's prefill through flash varlen attention, each scored as the cpu backend scores
the same tokens."""

from __future__ import annotations

import pytest
import torch

import pdmesh.shared.engine.build as engine_build
from pdmesh.shared.engine import LLM, SamplingParams
from tests.shared.engine.test_parity_hf import PROMPTS
from tests.shared.kernels.npu_standin import CALLED, npu_backend


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_attention_through_fia_and_the_paged_caches_scores_as_the_cpu_backend(
        tiny_models, monkeypatch, arch):
    """FIA (a prompt's first chunk, then chunks over the paged cache; decode steps as
    BSH), the caches' writes and MLA's paged attention, in float32 so the answer can be
    exact: the npu backend's half-only guards (its ops' documented dtypes) lifted for the
    stand-in, which computes float32 as readily. Each token's logprob, prompt and
    generated alike, as the cpu backend scores the same sequence in one forward pass."""
    path = str(tiny_models[arch])
    cpu = LLM(path, device="cpu", dtype="float32", block_size=128)
    backend = npu_backend()
    npu_globals = type(backend).rms_norm.__globals__
    monkeypatch.setitem(npu_globals, "_HALF", (torch.float16, torch.bfloat16, torch.float32))
    monkeypatch.setattr(type(backend), "_fia_ok", staticmethod(lambda q, kv_dtype, kvh: True))
    monkeypatch.setattr(engine_build, "get_backend", lambda device: backend)
    CALLED.clear()
    npu = LLM(path, device="cpu", dtype="float32", block_size=128,
              max_num_batched_tokens=48)  # (prompts of 49-130 tokens: in chunks)
    worst = worst_logprob_gap(npu, cpu)
    assert worst < 1e-3, worst
    attention = {"npu_fused_infer_attention_score", "_npu_reshape_and_cache"} \
        if arch == "qwen3" else {"npu_fused_infer_attention_score",
                                 "_npu_paged_attention_mla", "_npu_reshape_and_cache_siso"}
    assert attention <= set(CALLED), sorted(CALLED)


def worst_logprob_gap(llm: LLM, cpu: LLM) -> float:
    """The largest |logprob| difference of any token, prompt or generated (8 greedy ones),
    between ``llm``'s run of PROMPTS and the cpu backend scoring the same sequences in
    one forward pass each."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8,
                                                ignore_eos=True, logprobs=0,
                                                prompt_logprobs=0))
    worst = 0.0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        gen = out.outputs[0]
        seq = prompt + gen.token_ids
        [scored] = cpu.generate([seq], SamplingParams(max_tokens=1, prompt_logprobs=0))
        want = [d[t].logprob for d, t in zip(scored.prompt_logprobs[1:], seq[1:],
                                              strict=True)]
        got = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:],
                                             strict=True)]
        got += [d[t].logprob for d, t in zip(gen.logprobs, gen.token_ids, strict=True)]
        worst = max(worst, max(abs(a - b) for a, b in zip(got, want, strict=True)))
    return worst


def test_cuda_prefill_through_flash_varlen_scores_as_the_cpu_backend(tiny_models,
                                                                     monkeypatch):
    """The cuda backend's prefill through flash varlen attention - fresh prompts in one
    call, chunks over 256-token pages through the block table - its kernel the documented
    stand-in (tests/shared/kernels/test_cuda_backend.py), float32 let through for an exact
    answer: every token scored as the cpu backend scores it."""
    import pdmesh.shared.kernels.cuda as cuda
    from tests.shared.kernels.test_cuda_backend import documented_varlen_attn

    path = str(tiny_models["qwen3"])
    cpu = LLM(path, device="cpu", dtype="float32", block_size=256)
    calls: list = []
    backend = cuda.CUDABackend(torch.device("cpu"))
    backend._flash = documented_varlen_attn(calls)
    monkeypatch.setattr(cuda, "_FLASH_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    monkeypatch.setattr(engine_build, "get_backend", lambda device: backend)
    llm = LLM(path, device="cpu", dtype="float32", block_size=256,
              max_num_batched_tokens=48)
    assert worst_logprob_gap(llm, cpu) < 1e-3
    assert {c["paged"] for c in calls} == {True, False}  # (fresh and over the cache)
