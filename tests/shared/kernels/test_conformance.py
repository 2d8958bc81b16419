"""Every kernel backend present on this machine against the plain reference.

Parametrized by device: on a CPU box this checks the cpu backend; on an NPU or CUDA
box the same tests check those backends too (nothing here skips for lack of one; a
missing device is simply not in the parameter list, which pytest reports by name).
"""

from __future__ import annotations

import pytest
import torch

from pdmesh.shared.kernels import AttentionMetadata, available_devices, get_backend
from pdmesh.shared.kernels import reference as ref
from tests.shared.kernels.npu_standin import npu_backend

DEVICES = available_devices()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(),
                               rtol=TOL[dtype] * 2, atol=TOL[dtype] * 2)


# the npu backend on this machine too, over a CPU stand-in for torch_npu (npu_standin.py)
STANDINS = ["npu-standin"]


@pytest.fixture(scope="module")
def npu_standin():
    return npu_backend()


@pytest.fixture(params=[*DEVICES, *STANDINS])
def backend(request):
    if request.param == "npu-standin":
        return request.getfixturevalue("npu_standin")
    return get_backend(request.param)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_add(backend, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=g).to(dtype)
    res = torch.randn(7, 64, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype)
    dev = backend.device
    close(backend.rms_norm(x.to(dev), w.to(dev), 1e-6), ref.rms_norm(x, w, 1e-6), dtype)
    y, summed = backend.add_rms_norm(x.to(dev), res.to(dev), w.to(dev), 1e-6)
    close(summed, x + res, dtype)
    close(y, ref.rms_norm(x + res, w, 1e-6), dtype)
    # per-head norm on a 3-D view (Qwen3's q/k norm)
    x3 = torch.randn(5, 4, 32, generator=g).to(dtype)
    w3 = (1 + 0.1 * torch.randn(32, generator=g)).to(dtype)
    close(backend.rms_norm(x3.to(dev), w3.to(dev), 1e-6), ref.rms_norm(x3, w3, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding(backend, dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(6, 8, 32, generator=g).to(dtype)
    k = torch.randn(6, 2, 32, generator=g).to(dtype)
    angles = torch.rand(6, 16, generator=g) * 6.0
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    dev = backend.device
    qk = torch.cat((q, k), dim=1)  # query and key heads side by side, as the model calls it
    cos_t, sin_t = backend.rotary_tables(cos.to(dev), sin.to(dev))
    out = backend.rotary_embedding(qk.to(dev), cos_t, sin_t)
    close(out, ref.rotary(qk, cos, sin), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_rms_norm(backend, dtype):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 10, 32, generator=g).to(dtype)  # 8 query heads + 2 KV heads
    q_w, k_w = 1 + 0.1 * torch.randn(32, generator=g), 1 + 0.1 * torch.randn(32, generator=g)
    w = torch.cat((q_w.expand(8, 32), k_w.expand(2, 32))).to(dtype)
    dev = backend.device
    expected = torch.cat((ref.rms_norm(x[:, :8], q_w.to(dtype), 1e-6),
                          ref.rms_norm(x[:, 8:], k_w.to(dtype), 1e-6)), dim=1)
    close(backend.head_rms_norm(x.to(dev), w.to(dev), 1e-6), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(backend, dtype):
    x = torch.randn(9, 2 * 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    expected = ref.silu_and_mul(x)
    close(backend.silu_and_mul(x.clone().to(backend.device)), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("widths", [[40], [24, 8, 8]])  # one part; a fused q | k | v
@pytest.mark.parametrize("chunk", [64, 2])  # a slot one group; cut in groups of 2
def test_lora_shrink_expand(backend, dtype, widths, chunk):
    """Batched LoRA: each row gains, per part, x @ A_slot,part @ B_slot,part of its own
    slot (none for a base-model row), the reference a loop over the rows; the rows come
    grouped by slot as the engine groups them (uneven groups, padding, an empty slot,
    a slot's rows over several groups)."""
    from pdmesh.shared.engine.lora import group_rows

    g = torch.Generator().manual_seed(12)
    t, k, slots, rank, parts = 9, 48, 4, 4, len(widths)
    n = sum(widths)
    x = torch.randn(t, k, generator=g).to(dtype)
    a = (0.3 * torch.randn(slots, k, parts * rank, generator=g)).to(dtype)
    b_parts = [(0.3 * torch.randn(slots, rank, w, generator=g)).to(dtype) for w in widths]
    bounds = [(sum(widths[:p]), sum(widths[:p + 1])) for p in range(parts)]
    base = torch.randn(t, n, generator=g).to(dtype)
    slot_of = [0, 3, -1, 1, 3, -1, 3, 3, 1]  # (slot 2: no row)
    expected = base.double().clone()
    for row, s in enumerate(slot_of):
        if s < 0:
            continue
        for p, (lo, hi) in enumerate(bounds):
            cols = slice(p * rank, (p + 1) * rank)
            expected[row, lo:hi] += x[row].double() @ a[s, :, cols].double() @ \
                b_parts[p][s].double()
    groups, rows, valid = group_rows(slot_of, chunk)
    assert groups == ([0, 1, 3] if chunk > 3 else [0, 1, 3, 3])
    assert rows.shape[1] == (4 if chunk > 3 else 3) and int(valid.sum()) == 7
    dev = backend.device
    out = base.to(dev).clone()
    take = torch.tensor(groups)  # (each group's slot's weights, gathered as the engine does)
    backend.lora_shrink_expand(x.to(dev), a[take].to(dev), [b[take].to(dev) for b in b_parts],
                               bounds, rows.to(dev), valid.to(dev, dtype), out)
    close(out, expected.to(dtype), dtype)


def _paged_batch(ctx_lens, q_lens, block_size, kvh=2, h=8, d=32, dtype=torch.float32, seed=3,
                 consecutive=False):
    """ref.paged_batch, seeded."""
    return ref.paged_batch(ctx_lens, q_lens, block_size, kvh=kvh, h=h, d=d, dtype=dtype,
                           generator=torch.Generator().manual_seed(seed),
                           consecutive=consecutive)


def _to(meta: AttentionMetadata, dev: torch.device) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping.to(dev), query_start_loc=meta.query_start_loc.to(dev),
        seq_lens=meta.seq_lens.to(dev), context_lens=meta.context_lens.to(dev),
        block_tables=meta.block_tables.to(dev), query_lens_host=meta.query_lens_host,
        seq_lens_host=meta.seq_lens_host, context_lens_host=meta.context_lens_host,
        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
        block_size=meta.block_size)


def _run_attention(backend, ctx_lens, q_lens, block_size, dtype, consecutive=False):
    q, k, v, kc, vc, meta = _paged_batch(ctx_lens, q_lens, block_size, dtype=dtype,
                                         consecutive=consecutive)
    dev = backend.device
    dmeta = _to(meta, dev)
    kc_d, vc_d = kc.to(dev), vc.to(dev)
    backend.write_kv_cache(k.to(dev), v.to(dev), kc_d, vc_d, dmeta.slot_mapping)
    # reference cache: the same writes, done one slot at a time
    flat_k, flat_v = kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:])
    for row, slot in enumerate(meta.slot_mapping.tolist()):
        flat_k[slot], flat_v[slot] = k[row], v[row]
    close(kc_d, kc, dtype)
    close(vc_d, vc, dtype)
    backend.prepare_attention(dmeta)
    scale = q.shape[-1] ** -0.5
    if dmeta.is_decode:
        out = backend.paged_attention_decode(q.to(dev), kc_d, vc_d, dmeta, scale)
    else:
        out = backend.paged_attention_prefill(q.to(dev), k.to(dev), v.to(dev), kc_d, vc_d,
                                              dmeta, scale)
    close(out, ref.paged_attention(q, kc, vc, meta, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 128, 256])  # 256: flash paged KV on cuda
@pytest.mark.parametrize("case", ["decode", "decode_uniform", "decode_single", "fresh_prefill",
                                  "chunked_prefill", "uniform_chunks", "mixed", "verify"])
def test_paged_attention(backend, dtype, block_size, case):
    ctx_lens, q_lens = {
        "decode": ([5, 40, 0, 130], [1, 1, 1, 1]),
        "decode_uniform": ([150, 150, 150], [1, 1, 1]),  # no padding, no mask
        "decode_single": ([77], [1]),
        "fresh_prefill": ([0, 0, 0], [7, 33, 1]),
        "chunked_prefill": ([16, 3, 128], [20, 9, 5]),
        "uniform_chunks": ([32, 32], [16, 16]),
        "mixed": ([37, 0, 200, 12], [1, 21, 1, 17]),
        # speculative verification: a few tokens per sequence after context (and a short
        # fresh prompt among them)
        "verify": ([37, 5, 200, 0, 90], [4, 2, 1, 3, 17]),
    }[case]
    _run_attention(backend, ctx_lens, q_lens, block_size, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("ctx_lens", "q_lens"), [([300], [1]), ([40], [1]), ([150], [30])])
def test_paged_attention_consecutive_blocks(backend, dtype, ctx_lens, q_lens):
    _run_attention(backend, ctx_lens, q_lens, 16, dtype, consecutive=True)


# many sequences of odd lengths (one key; a block and one; several blocks and a part)
MANY_LENS = [1, 17, 3, 129, 64, 250, 2, 31, 95, 16, 200, 7]


@pytest.fixture(params=["best", "portable"])
def decode_path(backend, request):
    """The cpu backend's C decode kernel has an AVX-512 path and a portable one (AVX2 or
    plain x86-64): both are checked where the CPU has AVX-512 (elsewhere both are the
    portable one). Other backends have one path."""
    if not hasattr(backend, "portable_decode"):
        yield backend
        return
    backend.portable_decode = request.param == "portable"
    yield backend
    backend.portable_decode = False


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "float16", "int8"])
@pytest.mark.parametrize("block_size", [8, 16, 128])  # (cpu: 8 widened, else read in place)
@pytest.mark.parametrize(("kvh", "h", "d"),
                         [(2, 8, 32), (1, 6, 64), (4, 4, 48), (2, 4, 40), (1, 12, 64)])
def test_decode_over_many_sequences_and_every_cache(decode_path, cache, block_size, kvh, h,
                                                    d):
    """Decode rows of many sequences of odd lengths over caches as the engine keeps them
    (float32, bfloat16, float16, int8 with its per-token-and-head scales), grouped-query,
    multi-query and one query head per KV head: the reference over the same numbers."""
    backend = decode_path
    dtype = torch.float32 if cache == "int8" else getattr(torch, cache)
    q, k, v, kc, vc, meta = _paged_batch([n - 1 for n in MANY_LENS], [1] * len(MANY_LENS),
                                         block_size, kvh=kvh, h=h, d=d, dtype=dtype, seed=21)
    dev = backend.device
    dmeta = _to(meta, dev)
    # the query heads as the model hands them over: a slice of the step's q / k rows
    qd = torch.cat((q, q[:, :1]), dim=1).to(dev)[:, :h]
    if cache == "int8":
        (kq, ks), (vq, vs) = backend.quantize_kv(kc.to(dev)), backend.quantize_kv(vc.to(dev))
        backend.prepare_attention(dmeta)
        out = backend.paged_attention_decode_int8(qd, (kq, vq), (ks, vs), dmeta, d ** -0.5)
        kc, vc = (kq.cpu().float() * ks.cpu()), (vq.cpu().float() * vs.cpu())
    else:
        backend.prepare_attention(dmeta)
        out = backend.paged_attention_decode(qd, kc.to(dev), vc.to(dev), dmeta, d ** -0.5)
    close(out, ref.paged_attention(q, kc, vc, meta, d ** -0.5), dtype)


# prompt chunks after context of many lengths: a token after a long context, short
# chunks (speculative verification's), chunks across several tiles of queries and blocks,
# fresh prompts among them
PREFILL_CTX = [0, 250, 1, 40, 0, 129, 7, 300, 16, 95, 0, 33]
PREFILL_QUERIES = [1, 1, 3, 17, 40, 70, 100, 2, 5, 33, 24, 9]


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "float16", "int8"])
@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize(("kvh", "h", "d"),
                         [(2, 8, 32), (1, 6, 40), (4, 4, 48), (1, 80, 16)])
def test_prefill_over_many_sequences_and_every_cache(decode_path, cache, block_size, kvh,
                                                     h, d):
    """A step of prompt chunks after their context (and fresh prompts) read through the
    block tables, every cache the engine keeps (int8 with its scales), grouped-query,
    multi-query, one query head per KV head and more query heads than a tile's rows:
    the reference over the same numbers."""
    backend = decode_path
    dtype = torch.float32 if cache == "int8" else getattr(torch, cache)
    q, k, v, kc, vc, meta = _paged_batch(PREFILL_CTX, PREFILL_QUERIES, block_size, kvh=kvh,
                                         h=h, d=d, dtype=dtype, seed=23)
    dev = backend.device
    dmeta = _to(meta, dev)
    flat_k, flat_v = kc.view(-1, kvh, d), vc.view(-1, kvh, d)
    for row, slot in enumerate(meta.slot_mapping.tolist()):
        flat_k[slot], flat_v[slot] = k[row], v[row]
    # the query heads as the model hands them over: a slice of the step's q / k rows
    qd = torch.cat((q, q[:, :1]), dim=1).to(dev)[:, :h]
    backend.prepare_attention(dmeta)
    if cache == "int8":
        (kq, ks), (vq, vs) = backend.quantize_kv(kc.to(dev)), backend.quantize_kv(vc.to(dev))
        kc, vc = (kq.cpu().float() * ks.cpu()), (vq.cpu().float() * vs.cpu())
        # this step's k / v as the cache holds them (a fresh prompt may read either)
        k, v = (c.view(-1, kvh, d)[meta.slot_mapping] for c in (kc, vc))
        out = backend.paged_attention_prefill_int8(qd, k.to(dev), v.to(dev), (kq, vq),
                                                   (ks, vs), dmeta, d ** -0.5)
    else:
        out = backend.paged_attention_prefill(qd, k.to(dev), v.to(dev), kc.to(dev),
                                              vc.to(dev), dmeta, d ** -0.5)
    close(out, ref.paged_attention(q, kc, vc, meta, d ** -0.5), dtype)


@pytest.mark.parametrize("cache", ["float32", "int8"])
def test_latent_prefill_over_many_sequences(decode_path, cache):
    """MLA's absorbed prefill over one latent row per token, its values the first L dims,
    an int8 latent cache read with its scales."""
    backend = decode_path
    q, k, _, kc, _, meta = _paged_batch(PREFILL_CTX, PREFILL_QUERIES, 16, kvh=1, h=16, d=80,
                                        seed=24)
    dev = backend.device
    dmeta = _to(meta, dev)
    flat = kc.view(-1, 1, 80)
    for row, slot in enumerate(meta.slot_mapping.tolist()):
        flat[slot] = k[row]
    backend.prepare_attention(dmeta)
    if cache == "int8":
        cq, cs = backend.quantize_kv(kc.to(dev))
        kc = cq.cpu().float() * cs.cpu()
        k = kc.view(-1, 1, 80)[meta.slot_mapping]  # (this step's entries as the cache holds them)
        out = backend.latent_attention_prefill_int8(q.to(dev), k.to(dev), cq, cs, dmeta, 0.1,
                                                    64)
    else:
        out = backend.latent_attention_prefill(q.to(dev), k.to(dev), kc.to(dev), dmeta, 0.1,
                                               64)
    assert out.shape == (q.shape[0], 16, 64)
    close(out, ref.paged_attention(q, kc, kc, meta, 0.1)[..., :64], torch.float32)


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "float16", "int8"])
def test_latent_decode_over_many_sequences(decode_path, cache):
    """MLA's absorbed decode (one latent row of L + R per token, values its first L) over
    many sequences, an int8 latent cache read with its scales."""
    backend = decode_path
    dtype = torch.float32 if cache == "int8" else getattr(torch, cache)
    q, _, _, kc, _, meta = _paged_batch([n - 1 for n in MANY_LENS], [1] * len(MANY_LENS),
                                        16, kvh=1, h=16, d=80, dtype=dtype, seed=22)
    dev = backend.device
    dmeta = _to(meta, dev)
    backend.prepare_attention(dmeta)
    if cache == "int8":
        cq, cs = backend.quantize_kv(kc.to(dev))
        out = backend.latent_attention_decode_int8(q.to(dev), cq, cs, dmeta, 0.1, 64)
        kc = cq.cpu().float() * cs.cpu()
    else:
        out = backend.latent_attention_decode(q.to(dev), kc.to(dev), dmeta, 0.1, 64)
    assert out.shape == (len(MANY_LENS), 16, 64)
    close(out, ref.paged_attention(q, kc, kc, meta, 0.1)[..., :64], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["decode", "chunked_prefill", "fresh_prefill", "mixed",
                                  "verify"])
def test_latent_attention_over_one_cache(backend, dtype, case):
    """MLA's shape: one latent "head" of kv_lora_rank + rope dims (64 + 16 here) per
    token, written once and read as the keys and, its latent dims, the values; every
    query head attending over it."""
    ctx_lens, q_lens = {"decode": ([5, 40, 130], [1, 1, 1]),
                        "chunked_prefill": ([16, 3], [20, 9]),
                        "fresh_prefill": ([0, 0], [7, 33]),
                        "mixed": ([37, 0, 12], [1, 21, 17]),
                        "verify": ([37, 6, 120], [4, 1, 3])}[case]
    q, k, _, cache, _, meta = _paged_batch(ctx_lens, q_lens, 16, kvh=1, h=8, d=80,
                                           dtype=dtype, seed=11)
    dev = backend.device
    dmeta = _to(meta, dev)
    cache_d = cache.to(dev)
    backend.write_cache(k.to(dev), cache_d, dmeta.slot_mapping)
    flat = cache.view(-1, *cache.shape[2:])
    for row, slot in enumerate(meta.slot_mapping.tolist()):
        flat[slot] = k[row]
    close(cache_d, cache, dtype)
    backend.prepare_attention(dmeta)
    latent = 64  # the values: each entry's latent, not its 16 rope dims
    if dmeta.is_decode:
        out = backend.latent_attention_decode(q.to(dev), cache_d, dmeta, 0.1, latent)
    else:
        out = backend.latent_attention_prefill(q.to(dev), k.to(dev), cache_d, dmeta, 0.1,
                                               latent)
    assert out.shape == (q.shape[0], q.shape[1], latent)
    close(out, ref.paged_attention(q, cache, cache, meta, 0.1)[..., :latent], dtype)


@pytest.mark.parametrize("scoring", ["sigmoid", "sqrtsoftplus", "softmax"])
@pytest.mark.parametrize(("groups", "topk_groups"), [(1, 1), (4, 2), (8, 3)])
def test_moe_grouped_topk_routing(backend, groups, topk_groups, scoring):
    """DeepSeek-V3's sigmoid routing, and DeepSeek-V4's sqrtsoftplus / softmax scores."""
    g = torch.Generator().manual_seed(groups)
    logits = torch.randn(33, 16, generator=g)
    bias = 0.1 * torch.randn(16, generator=g)
    dev = backend.device
    weights, ids = backend.moe_gating_grouped_topk(logits.to(dev), 4, groups, topk_groups,
                                                   bias.to(dev), True, 2.5, scoring)
    exp_w, exp_ids = ref.grouped_topk(logits, 4, groups, topk_groups, bias, True, 2.5,
                                      scoring)
    got_ids, order = ids.cpu().long().sort(dim=-1)
    want_ids, want_order = exp_ids.sort(dim=-1)
    assert torch.equal(got_ids, want_ids)
    close(weights.cpu().float().gather(1, order), exp_w.float().gather(1, want_order),
          torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_gating_and_experts(backend, dtype):
    g = torch.Generator().manual_seed(4)
    num_tokens, hidden, inter, experts, top_k = 11, 32, 24, 6, 2
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(num_tokens, experts, generator=g).to(dtype)
    w13 = (0.2 * torch.randn(experts, 2 * inter, hidden, generator=g)).to(dtype)
    w2 = (0.2 * torch.randn(experts, hidden, inter, generator=g)).to(dtype)
    dev = backend.device
    weights, ids = backend.moe_gating_topk(logits.to(dev), top_k, renormalize=True)
    probs = torch.softmax(logits.double(), dim=-1)
    exp_w, exp_ids = probs.topk(top_k, dim=-1)
    exp_w = exp_w / exp_w.sum(-1, keepdim=True)
    assert torch.equal(ids.cpu().long(), exp_ids)
    close(weights.float(), exp_w, dtype)
    # the engine stores experts input-major: w13 [E, H, 2I], w2 [E, I, H]
    out = backend.fused_moe(x.to(dev), w13.transpose(1, 2).contiguous().to(dev),
                            w2.transpose(1, 2).contiguous().to(dev), exp_w.to(dev, dtype),
                            exp_ids.to(dev))
    close(out, ref.moe(x, w13, w2, exp_w.to(dtype), exp_ids), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_with_a_swiglu_limit(backend, dtype):
    """DeepSeek-V4's clamp: gate at most the limit, up within +-limit, before silu * up."""
    g = torch.Generator().manual_seed(14)
    num_tokens, hidden, inter, experts, top_k = 9, 32, 24, 5, 2
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w13 = (0.5 * torch.randn(experts, 2 * inter, hidden, generator=g)).to(dtype)
    w2 = (0.2 * torch.randn(experts, hidden, inter, generator=g)).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=g)
    dev = backend.device
    want = ref.moe(x, w13, w2, weights.to(dtype), ids, limit=0.7)
    assert not torch.allclose(want.double(), ref.moe(x, w13, w2, weights.to(dtype), ids).double(),
                              atol=1e-3)  # the limit clips here
    out = backend.fused_moe(x.to(dev), w13.transpose(1, 2).contiguous().to(dev),
                            w2.transpose(1, 2).contiguous().to(dev), weights.to(dev, dtype),
                            ids.to(dev), 0.7)
    close(out, want, dtype)
    h = (torch.randn(num_tokens, 2 * inter, generator=g) * 2).to(dtype)
    close(backend.silu_and_mul(h.clone().to(dev), 0.7), ref.silu_and_mul(h, 0.7), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("seqs", "queries", "keys"), [(1, 9, 20), (3, 1, 24), (2, 5, 7)])
def test_sink_attention(backend, dtype, seqs, queries, keys):
    """DeepSeek-V4's attention: many query heads over one K=V head per sequence, a
    visibility mask (window and chosen entries), a learned sink per head; a query that
    sees nothing gives zeros."""
    g = torch.Generator().manual_seed(seqs * 100 + queries)
    heads, dim = 4, 32
    q = torch.randn(seqs, heads, queries, dim, generator=g).to(dtype)
    kv = torch.randn(seqs, keys, dim, generator=g).to(dtype)
    visible = torch.rand(seqs, queries, keys, generator=g) < 0.6
    visible[0, 0] = False
    sinks = torch.randn(heads, generator=g)
    dev = backend.device
    out = backend.sink_attention(q.to(dev), kv.to(dev), visible.to(dev), sinks.to(dev), 0.17)
    want = ref.sink_attention(q, kv, visible, sinks, 0.17)
    assert float(want[0, :, 0].abs().max()) == 0.0
    close(out, want, dtype)


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "float16", "int8"])
@pytest.mark.parametrize(("seqs", "heads", "dim"), [(12, 8, 64), (1, 16, 32), (3, 5, 40)])
def test_sink_decode_over_listed_rows(decode_path, cache, seqs, heads, dim):
    """DeepSeek-V4's decode attention over keys listed by their cache rows (a window's,
    then chosen entries' of another cache; rows anywhere, some listed but not seen, one
    sequence that sees nothing), read where they lie: the reference over the same rows."""
    backend = decode_path
    g = torch.Generator().manual_seed(seqs * 10 + heads)
    dtype = torch.float32 if cache == "int8" else getattr(torch, cache)
    dev = backend.device
    q = torch.randn(seqs, heads, dim, generator=g).to(dtype)
    sinks = torch.randn(heads, generator=g)
    sources, rows, seen = [], [], []
    for listed, n_rows in ((21, 48), (70, 300)):  # a window's rows, then entries'
        rows_f = torch.randn(n_rows // 16 + 1, 16, 1, dim, generator=g).to(dtype)
        slots = torch.randint(0, rows_f.shape[0] * 16, (seqs, listed), generator=g)
        visible = torch.rand(seqs, listed, generator=g) < 0.7
        visible[0] = False
        if cache == "int8":
            cq, sc = backend.quantize_kv(rows_f.to(dev))
            sources.append((cq, sc, slots.to(dev), visible.to(dev)))
            rows_f = cq.cpu().float() * sc.cpu()
        else:
            sources.append((rows_f.to(dev), None, slots.to(dev), visible.to(dev)))
        rows.append(rows_f.view(-1, dim)[slots])
        seen.append(visible)
    out = backend.sink_attention_decode(q.to(dev), sources, sinks.to(dev), 0.17)
    want = ref.sink_attention(q.unsqueeze(2), torch.cat(rows, 1),
                              torch.cat(seen, -1).unsqueeze(1), sinks, 0.17)[:, :, 0]
    assert out.shape == (seqs, heads, dim) and float(want[0].abs().max()) == 0.0
    close(out, want, dtype)


@pytest.mark.parametrize(("tokens", "n", "iters"), [(1, 4, 20), (33, 4, 3), (7, 6, 1), (0, 4, 5)])
def test_hc_sinkhorn(backend, tokens, n, iters):
    """DeepSeek-V4's hyper-connection mixing matrices made (nearly) doubly stochastic:
    columns first, then rows and columns, each x / (sum + eps)."""
    g = torch.Generator().manual_seed(tokens * 10 + n)
    comb = torch.softmax(3 * torch.randn(tokens, n, n, generator=g), dim=-1) + 1e-6
    out = backend.hc_sinkhorn(comb.clone().to(backend.device), iters, 1e-6)
    want = ref.hc_sinkhorn(comb, iters, 1e-6)
    assert out.shape == comb.shape and out.dtype == torch.float32
    close(out, want, torch.float32)
    if tokens and iters >= 20:  # columns sum to one (the last step), rows nearly
        ones = torch.ones(tokens, n, dtype=want.dtype)
        torch.testing.assert_close(want.sum(-2), ones, atol=1e-5, rtol=0)
        torch.testing.assert_close(want.sum(-1), ones, atol=1e-2, rtol=0)


def test_grouped_matmul(backend):
    g = torch.Generator().manual_seed(5)
    sizes = [3, 0, 5, 1]
    x = torch.randn(sum(sizes), 16, generator=g)
    w = torch.randn(4, 16, 8, generator=g)  # [E, K, M]
    out = backend.grouped_matmul(x.to(backend.device), w.to(backend.device), sizes)
    expected = torch.cat([x[s:s + n] @ w[e] for e, (s, n) in
                          enumerate(zip([0, 3, 3, 8], sizes, strict=True))])
    close(out, expected, torch.float32)


def test_greedy(backend):
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(9))
    got = backend.greedy(logits.to(backend.device)).cpu()
    assert got.tolist() == [int(torch.argmax(row)) for row in logits]


def test_top_k_top_p(backend):
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 50, generator=g) * 3
    top_k = [50, 5, 1, 50, 10]
    top_p = [1.0, 1.0, 1.0, 0.6, 0.3]
    dev = backend.device
    out = backend.top_k_top_p(logits.to(dev), torch.tensor(top_k, device=dev),
                              torch.tensor(top_p, device=dev))
    expected = ref.top_k_top_p(logits, top_k, top_p)
    assert torch.equal(torch.isinf(out.cpu()), torch.isinf(expected))
    kept = ~torch.isinf(expected)
    close(out.cpu()[kept], expected[kept], torch.float32)


def test_random_sample_follows_distribution_and_seeds(backend):
    dev = backend.device
    probs = torch.tensor([[0.7, 0.2, 0.1, 0.0]] * 4000, device=dev)
    counts = torch.bincount(backend.random_sample(probs, {}).cpu(), minlength=4).double()
    freq = counts / counts.sum()
    assert counts[3] == 0
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1, 0.0], dtype=torch.float64),
                               atol=0.03, rtol=0)
    p = torch.softmax(torch.randn(3, 100, generator=torch.Generator().manual_seed(7)), -1)
    runs = []
    for _ in range(2):
        gens = {0: torch.Generator().manual_seed(11), 2: torch.Generator().manual_seed(12)}
        runs.append(backend.random_sample(p.to(dev), gens).cpu())
    assert runs[0][0] == runs[1][0] and runs[0][2] == runs[1][2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_in_sequence(backend, dtype):
    """Several decode steps in a row, as the engine runs them: backends may carry state
    from one step to the next (the CPU backend's KV mirror), so every step is checked,
    across block boundaries, a batch that shrinks, and one that changes."""
    g = torch.Generator().manual_seed(10)
    bs, kvh, h, d, num_blocks = 4, 2, 8, 32, 64
    dev = backend.device
    kc = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    kc_d, vc_d = kc.to(dev), vc.to(dev)
    free = list(range(1, num_blocks))
    seqs = {i: {"len": n, "blocks": [free.pop(0) for _ in range(-(-n // bs))]}
            for i, n in enumerate([5, 9, 3])}
    schedule = [[0, 1, 2]] * 5 + [[0, 2]] * 3 + [[2, 0]] * 2 + [[0, 1, 2]] * 2
    for active in schedule:
        for i in active:  # room for one more token each
            s = seqs[i]
            if s["len"] + 1 > len(s["blocks"]) * bs:
                s["blocks"].append(free.pop(0))
        lens = [seqs[i]["len"] + 1 for i in active]
        width = max(len(seqs[i]["blocks"]) for i in active)
        table = torch.zeros(len(active), width, dtype=torch.int32)
        for row, i in enumerate(active):
            table[row, :len(seqs[i]["blocks"])] = torch.tensor(seqs[i]["blocks"])
        slots = [seqs[i]["blocks"][(n - 1) // bs] * bs + (n - 1) % bs
                 for i, n in zip(active, lens, strict=True)]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(len(active) + 1,
                                                                           dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            context_lens=torch.tensor([n - 1 for n in lens], dtype=torch.int32),
            block_tables=table, query_lens_host=[1] * len(active), seq_lens_host=lens,
            context_lens_host=[n - 1 for n in lens], max_query_len=1, max_seq_len=max(lens),
            block_size=bs, block_tables_host=table.numpy())
        q = torch.randn(len(active), h, d, generator=g).to(dtype)
        k = torch.randn(len(active), kvh, d, generator=g).to(dtype)
        v = torch.randn(len(active), kvh, d, generator=g).to(dtype)
        dmeta = _to(meta, dev)
        dmeta.block_tables_host = meta.block_tables_host
        backend.write_kv_cache(k.to(dev), v.to(dev), kc_d, vc_d, dmeta.slot_mapping)
        for row, slot in enumerate(slots):
            kc.view(-1, kvh, d)[slot], vc.view(-1, kvh, d)[slot] = k[row], v[row]
        backend.prepare_attention(dmeta)
        out = backend.paged_attention_decode(q.to(dev), kc_d, vc_d, dmeta, d ** -0.5)
        close(out, ref.paged_attention(q, kc, vc, meta, d ** -0.5), dtype)
        for i, n in zip(active, lens, strict=True):
            seqs[i]["len"] = n
    mirror = getattr(backend, "_mirror", None)  # the dense path's; others keep no state
    if getattr(backend, "_paged", False):  # the cpu backend's C kernel: read in place
        assert mirror.appends == mirror.rebuilds == 0
    elif mirror is not None:
        assert mirror.appends >= 6 and mirror.rebuilds >= 3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_int8_linear_is_w8a8_dynamic(backend, dtype, rows):
    """Per-token dynamic int8 activations times per-channel int8 weights: what the
    definition computes (float64), close to the float product (cosine >= 0.999), every
    weight scale read (one scale doubled doubles its column alone)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    w = 0.05 * torch.randn(64, 48, generator=g)
    qweight, scale = ref.quantize_per_channel(w)
    assert qweight.dtype == torch.int8 and scale.shape == (48,)
    dev = backend.device
    got = backend.int8_linear(x.to(dev), qweight.to(dev), scale.to(dev))
    assert got.dtype == dtype and got.shape == (rows, 48)
    seen, tol = npu_int8_view(backend, x)
    close(got, ref.int8_linear(seen, qweight, scale).to(dtype), tol)
    exact = (x.double() @ w.double()).flatten()
    cosine = torch.nn.functional.cosine_similarity(got.cpu().double().flatten(), exact, dim=0)
    assert cosine >= 0.999, float(cosine)
    doubled = scale.clone()
    doubled[3] *= 2
    again = backend.int8_linear(x.to(dev), qweight.to(dev), doubled.to(dev)).cpu()
    close(again[:, 3], 2 * got[:, 3].cpu(), dtype)
    close(torch.cat((again[:, :3], again[:, 4:]), 1),
          torch.cat((got[:, :3], got[:, 4:]), 1).cpu(), dtype)
    q, s = backend.dynamic_quant(x.to(dev))
    assert q.dtype == torch.int8 and s.shape == (rows,) and int(q.abs().max()) <= 127
    # x ~ q * scale, within half a step (and the rounding of x to what the op takes)
    err = (q.cpu().float() * s.cpu()[:, None] - x.float()).abs()
    assert bool((err <= s.cpu()[:, None] * 0.5 + TOL[tol] * x.float().abs()).all())


def _quantized(scheme: str, k: int, n: int, g: torch.Generator, offsets: bool = False):
    from pdmesh.shared.kernels.quant import QuantLinear

    hi = 7 if scheme == "w4a8_dynamic" else 127
    q = torch.randint(-hi - (scheme == "w4a8_dynamic"), hi + 1, (k, n), generator=g,
                      dtype=torch.int8)
    scale = torch.rand(n, generator=g) / 40 + 1e-3
    if scheme != "w8a8":
        offset = torch.randint(-3, 4, (n,), generator=g).float() if offsets else None
        return QuantLinear(scheme, q, scale, offset)
    # offsets: two runs of columns with their own input scale and zero point (q | kv
    # calibrated apart); else one, as a projection calibrated whole
    runs = dict(input_scale=(0.03, 0.011), input_offset=(0.0, -7.0), bounds=(0, n // 3, n)) \
        if offsets else dict(input_scale=(0.021,), input_offset=(5.0,), bounds=(0, n))
    return QuantLinear(scheme, q, scale, deq_scale=scale * 0.03,
                       quant_bias=torch.randint(-900, 900, (n,), generator=g, dtype=torch.int32),
                       **runs)


def npu_int8_view(backend, x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """(x as the int8 path quantizes it, the tolerance of its answer): the npu's
    quantizing ops take float16 / bfloat16 (npu_dynamic_quant's documented inputs; the
    static path's scales in x's dtype, as vLLM-Ascend passes them), so a float32 x goes
    through bfloat16 there and comes back from a bfloat16 product; elsewhere x as is."""
    if backend.name == "npu" and x.dtype == torch.float32:
        return x.to(torch.bfloat16), torch.bfloat16
    return x, x.dtype


def _on(w, dev):
    import dataclasses

    return dataclasses.replace(w, **{f.name: getattr(w, f.name).to(dev)
                                     for f in dataclasses.fields(w)
                                     if isinstance(getattr(w, f.name), torch.Tensor)})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("scheme", "offsets"), [
    ("w8a8_dynamic", False), ("w8a8_dynamic", True), ("w4a8_dynamic", False),
    ("w4a8_dynamic", True), ("w8a8", False), ("w8a8", True)])
def test_quantized_linear_is_its_scheme(backend, dtype, scheme, offsets):
    """``linear`` on a QuantLinear computes the scheme's definition (reference, float64):
    dynamic per-token int8 with weight zero points, int4 weights, static per-tensor
    activations (in one run, or runs of columns with their own scales), quant_bias and
    deq_scale; as the engine loads it too (``prepare``: the cpu backend's VNNI tiles)."""
    g = torch.Generator().manual_seed(12)
    w = _quantized(scheme, 64, 48, g, offsets)
    # as loaded: in the backend's own layout too, where it has one (cpu: VNNI tiles)
    prepared = backend.prepare(_on(w, backend.device))
    for rows in (1, 4, 7, 33):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        seen, tol = npu_int8_view(backend, x)
        expected = ref.quant_linear(seen, w, seen.dtype if backend.name == "npu" else None)
        for weight in (_on(w, backend.device), prepared):
            got = backend.linear(x.to(backend.device), weight)
            assert got.dtype == dtype and got.shape == (rows, 48)
            close(got, expected.to(dtype), tol)


def test_grouped_matmul_takes_quantized_experts(backend):
    from pdmesh.shared.kernels.quant import QuantExperts

    g = torch.Generator().manual_seed(13)
    sizes = [3, 0, 5, 1]
    x = torch.randn(sum(sizes), 16, generator=g)
    experts = QuantExperts("w8a8_dynamic",
                           torch.randint(-127, 128, (4, 16, 8), generator=g, dtype=torch.int8),
                           torch.rand(4, 8, generator=g) / 50)
    expected = torch.cat([ref.quant_linear(x[s:s + n], experts.expert(e)) for e, (s, n) in
                          enumerate(zip([0, 3, 3, 8], sizes, strict=True))])
    on = _on(experts, backend.device)
    for weight in (on, backend.prepare(on)):
        out = backend.grouped_matmul(x.to(backend.device), weight, sizes)
        close(out, expected, torch.bfloat16 if backend.name == "npu" else torch.float32)


@pytest.mark.parametrize("rows", [1, 5, 130])
def test_fp8_block_linear(backend, rows):
    """DeepSeek's block FP8: held dequantized, x @ weight exactly; where the backend has
    an FP8 GEMM (cuda on SM90), FP8 blocks and per-128-column FP8 activations, within
    FP8's rounding of the float product (cosine >= 0.995)."""
    from pdmesh.shared.kernels.quant import QuantLinear, quantize_fp8_blocks

    g = torch.Generator().manual_seed(14)
    fp8, scale = quantize_fp8_blocks(0.05 * torch.randn(384, 256, generator=g))  # [N, K]
    dense = (fp8.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
             ).to(torch.bfloat16)
    w = QuantLinear("fp8_block", dense.t().contiguous().to(backend.device),
                    torch.ones(384, device=backend.device))
    prepared = backend.prepare(w)
    x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
    got = backend.linear(x.to(backend.device), prepared).cpu()
    exact = x.double() @ dense.double().t()
    assert got.shape == (rows, 384) and got.dtype == torch.bfloat16
    if prepared.packed is None:
        close(got, x.float() @ dense.float().t(), torch.bfloat16)
    else:
        assert prepared.packed.dtype == torch.float8_e4m3fn
        cos = torch.nn.functional.cosine_similarity(got.double().flatten(), exact.flatten(),
                                                    dim=0)
        assert cos >= 0.995, float(cos)


def test_every_op_of_the_npu_standin_ran(npu_standin):
    """Last in this file (it runs in order): the npu backend went through each torch_npu
    op it calls (at least one case of the suite fit each op's documented constraints),
    not only through its fallbacks."""
    from tests.shared.kernels.npu_standin import CALLED, OPS

    assert sorted(set(OPS) - set(CALLED)) == []
