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
