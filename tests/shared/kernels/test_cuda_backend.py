"""The cuda backend's prefill routing, on this machine's CPU.

The flash varlen kernel itself runs only on a GPU (the conformance suite checks it there
against the reference); here a stand-in computes what ``varlen_attn``'s documentation
says it computes, so these tests check what the backend hands it (cumulative lengths,
the paged cache through the block table, causal aligned to the bottom right) and when
it does not call it at all.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdmesh.shared.kernels import reference as ref
from pdmesh.shared.kernels.cuda import CUDABackend
from tests.shared.kernels.test_conformance import _paged_batch, close


def documented_varlen_attn(calls: list):
    """varlen_attn as torch documents it: per sequence, queries cu_seq_q[i]:cu_seq_q[i+1]
    over keys cu_seq_k[i]:cu_seq_k[i+1] (or, with a block table, the first seqused_k[i]
    tokens of its pages); window (-1, 0) is causal aligned to the bottom right."""

    def attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
             window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None):
        calls.append({"paged": block_table is not None, "max_q": max_q, "max_k": max_k})
        out = torch.empty_like(query)
        h = query.shape[1]
        for i in range(len(cu_seq_q) - 1):
            q = query[cu_seq_q[i]:cu_seq_q[i + 1]].double()
            if block_table is None:
                k, v = (x[cu_seq_k[i]:cu_seq_k[i + 1]] for x in (key, value))
            else:
                n = int(seqused_k[i])
                k, v = (ref.gather_sequence(x, block_table[i].tolist(), n) for x in (key, value))
            assert max(q.shape[0], 1) <= max_q and k.shape[0] <= max_k
            k, v = (x.double().repeat_interleave(h // x.shape[1], dim=1) for x in (k, v))
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            if window_size == (-1, 0):
                lq, lk = q.shape[0], k.shape[0]
                hidden = torch.arange(lk)[None, :] > lk - lq + torch.arange(lq)[:, None]
                scores = scores.masked_fill(hidden, float("-inf"))
            out[cu_seq_q[i]:cu_seq_q[i + 1]] = torch.einsum(
                "hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
        return out

    return attn


def _prefill(backend, ctx_lens, q_lens, block_size, dtype):
    q, k, v, kc, vc, meta = _paged_batch(ctx_lens, q_lens, block_size, dtype=dtype)
    flat_k, flat_v = kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:])
    flat_k[meta.slot_mapping], flat_v[meta.slot_mapping] = k, v  # the step's own writes
    backend.prepare_attention(meta)
    out = backend.paged_attention_prefill(q, k, v, kc, vc, meta, q.shape[-1] ** -0.5)
    close(out, ref.paged_attention(q, kc, vc, meta, q.shape[-1] ** -0.5), dtype)


@pytest.fixture
def flash_calls():
    return []


@pytest.fixture
def backend(flash_calls):
    b = CUDABackend(torch.device("cpu"))
    assert b._flash is None  # the real kernel does not run on a CPU: found out at start
    b._flash = documented_varlen_attn(flash_calls)
    return b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fresh_prompts_of_different_lengths_are_one_flash_call(backend, flash_calls, dtype):
    _prefill(backend, [0, 0, 0], [7, 33, 1], 16, dtype)
    assert flash_calls == [{"paged": False, "max_q": 33, "max_k": 33}]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chunks_after_context_read_the_paged_cache_through_the_block_table(
        backend, flash_calls, dtype):
    # a prefix hit, a chunk and a decode row in one step, pages of 256 tokens
    _prefill(backend, [300, 16, 40], [20, 9, 1], 256, dtype)
    assert flash_calls == [{"paged": True, "max_q": 20, "max_k": 320}]


@pytest.mark.parametrize(("dtype", "block_size", "ctx_lens"), [
    (torch.float32, 16, [0, 0]),  # flash takes fp16 / bf16 only
    (torch.float16, 128, [16, 3]),  # paged context needs pages of a multiple of 256
])
def test_outside_flash_contract_runs_per_sequence(backend, flash_calls, dtype, block_size,
                                                  ctx_lens):
    _prefill(backend, ctx_lens, [20, 9], block_size, dtype)
    assert flash_calls == []


def test_without_the_kernel_every_step_runs_per_sequence():
    plain = CUDABackend(torch.device("cpu"))
    _prefill(plain, [0, 0, 0], [7, 33, 1], 16, torch.float16)
    _prefill(plain, [16, 3, 128], [20, 9, 5], 16, torch.float16)


def documented_scaled_mm(calls: list):
    """F.scaled_mm with DeepSeek's block recipes, as torch's own tests build them
    (test/test_scaled_matmul_cuda.py; benchmarks' ScaledMMBenchmark): mat_a [M, K] FP8 with
    BlockWise1x128 decode scales [M, K / 128], outer-dim-major (stride (1, M)); mat_b
    [K, N] FP8, column-major, with BlockWise128x128 decode scales [L4, N / 128] (the K
    blocks L padded to a multiple of 4, then transposed); out = sum over K blocks of
    (a * its scale) @ (b * its scale), as output_dtype."""
    def scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b,
                  swizzle_a=None, swizzle_b=None, bias=None, output_dtype=torch.bfloat16,
                  contraction_dim=(), use_fast_accum=False):
        calls.append(mat_a.shape[0])
        fp8 = torch.float8_e4m3fn
        (m, k), n = mat_a.shape, mat_b.shape[1]
        assert mat_a.dtype == mat_b.dtype == fp8 and mat_b.shape[0] == k
        assert scale_recipe_a == F.ScalingType.BlockWise1x128
        assert scale_recipe_b == F.ScalingType.BlockWise128x128
        assert mat_a.is_contiguous() and mat_b.t().is_contiguous()  # (b column-major)
        blocks = k // 128
        assert scale_a.shape == (m, blocks) and scale_a.stride() == (1, m), \
            "BlockWise1x128 scales are (M, K/128), outer-dim-major"
        assert scale_b.shape == (-(-blocks // 4) * 4, n // 128), \
            "BlockWise128x128 scales are (L4, N/128)"
        a = mat_a.double().view(m, blocks, 128) * scale_a.double().unsqueeze(-1)
        sb = scale_b.double()[:blocks].repeat_interleave(128, 0).repeat_interleave(128, 1)
        out = a.view(m, k) @ (mat_b.double() * sb)
        return out.to(output_dtype)

    return scaled_mm


@pytest.mark.parametrize("rows", [1, 6, 130])
def test_fp8_block_linear_hands_scaled_mm_the_block_recipes(monkeypatch, rows):
    """The SM90 path, its GEMM the documented recipe above: what the backend hands it
    (layouts, strides, padded rows and scale blocks) gives the float product within
    FP8's rounding; K of 3 blocks pads its weight scales to 4."""
    from pdmesh.shared.kernels.quant import QuantLinear, quantize_fp8_blocks

    calls: list = []
    monkeypatch.setattr(F, "scaled_mm", documented_scaled_mm(calls))
    b = CUDABackend(torch.device("cpu"))
    b._fp8_gemm = True  # (found false on a CPU: here the stand-in runs it)
    g = torch.Generator().manual_seed(14)
    fp8, scale = quantize_fp8_blocks(0.05 * torch.randn(256, 384, generator=g))  # [N, K]
    dense = (fp8.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
             ).to(torch.bfloat16)
    prepared = b.prepare(QuantLinear("fp8_block", dense.t().contiguous(), torch.ones(256)))
    assert prepared.packed is not None and prepared.packed.dtype == torch.float8_e4m3fn
    x = torch.randn(rows, 384, generator=g).to(torch.bfloat16)
    got = b.linear(x, prepared)
    assert got.shape == (rows, 256) and got.dtype == torch.bfloat16
    assert calls == [-(-rows // 4) * 4]  # (rows padded to a multiple of 4)
    exact = x.double() @ dense.double().t()
    cos = F.cosine_similarity(got.double().flatten(), exact.flatten(), dim=0)
    assert cos >= 0.995, float(cos)
