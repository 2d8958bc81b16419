"""A CPU stand-in for torch_npu (issue 42): the ops pdmesh's npu backend calls, each taking
its arguments as the op's schema in torch-npu's wheel declares them (a call the real
binding would refuse raises TypeError here) and computing what torch-npu's own
documentation (``torch_npu/_op_plugin_docs.py`` in the same wheel) says it computes, in
plain torch, with the layouts and the refusals the documentation gives. Installed as
``sys.modules["torch_npu"]`` it lets shared/kernels/npu.py run on this machine.

Where the documentation leaves something open, the stand-in says what it guessed
(``GUESSED``). The second results pdmesh discards (FIA's softmax_lse, the gating ops'
row_idx / norm_out, npu_rms_norm's rstd) are computed as documented but not checked.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pdmesh.shared.kernels.device_schemas import Schema, npu_schemas

# what the stand-in had to decide that the documentation does not say
GUESSED = {
    "npu_moe_gating_top_k_softmax": "row_idx[i, j] = j * rows + i (the doc gives its "
                                    "shape and dtype only); unused by pdmesh",
    "npu_fused_infer_attention_score": "softmax_lse is returned as zeros [1] (pdmesh "
                                       "does not ask for it: softmax_lse_flag false)",
    "npu_dynamic_quant": "round() taken as half to even, torch's (the doc does not say; "
                         "half away from zero would differ on exact .5 only)",
    "npu_quantize": "round() likewise half to even",
}

# how vLLM-Ascend (182b75e, on torch-npu 2.10) calls the same ops, where it differs from
# pdmesh's calls (docs/npu-backend.md has the sites on both sides)
VLLM_ASCEND = {
    "npu_rms_norm": "same call; its q/k norm passes the [D] weight as gamma where pdmesh "
                    "normalizes with a unit gamma and multiplies by [N, D] after",
    "npu_add_rms_norm": "same",
    "npu_rotary_mul": "same layout (its vision path); its LLM rotary is npu_mrope or Triton",
    "_npu_reshape_and_cache": "same arguments on 310P; A2/A3 use npu_scatter_pa_kv_cache "
                              "(cache_mode Norm) instead",
    "npu_fused_infer_attention_score": "TND calls the same; decode is TND there (pdmesh: "
                                       "BSH, the call vLLM-Ascend had until ac357ed); head "
                                       "size 512 goes to npu_fusion_attention",
    "_npu_reshape_and_cache_siso": "same keywords (no longer called: MLA writes through "
                                   "npu_kv_rmsnorm_rope_cache)",
    "_npu_paged_attention_mla": "same keywords (no longer called: MLA decode is "
                                "npu_fused_infer_attention_score_v2 with query_rope)",
    "npu_swiglu": "same; with a swiglu limit it clamps first and still calls it (pdmesh: "
                  "the generic path)",
    "npu_moe_gating_top_k_softmax": "310P only there; A2/A3 route through a custom "
                                    "moe_gating_top_k",
    "npu_moe_gating_top_k": "A5 only there (A2/A3: a custom op), without out_flag",
    "npu_dynamic_quant": "same",
    "npu_quant_matmul": "same arguments; its weights in the NZ layout, its scales in the "
                        "model's dtype",
    "npu_quantize": "same (the reciprocal scale and offset built once at load)",
    "npu_grouped_matmul": "same arguments; routing by npu_moe_init_routing_v2 / "
                          "npu_moe_token_unpermute, int8 experts through fused dequant "
                          "kernels, NZ weights",
    "npu_top_k_top_p": "by keyword with either of p / k None and k up to the vocabulary "
                       "(pdmesh: both, k <= 1024, as the 2.14 documentation says)",
}


def _rms(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor,
                                                                    torch.Tensor]:
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def npu_rms_norm(self, gamma, epsilon=1e-6):
    """y = x / sqrt(mean(x^2) + eps) * gamma; (y, rstd). gamma of x's dtype."""
    if gamma.dtype != self.dtype:
        raise RuntimeError("npu_rms_norm: gamma's dtype must be x's")
    return _rms(self, gamma, epsilon)


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    """(rms_norm(x1 + x2), rstd, x1 + x2); x1, x2 and gamma of one dtype."""
    if not x1.dtype == x2.dtype == gamma.dtype:
        raise RuntimeError("npu_add_rms_norm: x1, x2 and gamma must share a dtype")
    summed = (x1.float() + x2.float()).to(x1.dtype)
    y, rstd = _rms(summed, gamma, epsilon)
    return y, rstd, summed


def npu_rotary_mul(self, r1, r2, rotary_mode="half", rotate=None):
    """rotary_mode "half": x * r1 + cat(-x[..., D/2:], x[..., :D/2]) * r2; 4-D x, r1 / r2
    broadcast to it (BSND: 1S1D)."""
    if self.dim() != 4 or r1.dim() != 4 or r2.dim() != 4:
        raise RuntimeError("npu_rotary_mul: x, r1 and r2 must be 4-D")
    if rotary_mode != "half":
        raise NotImplementedError("stand-in: rotary_mode 'half' only")
    x1, x2 = self.float().chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (self.float() * r1.float() + rotated * r2.float()).to(self.dtype)


def npu_swiglu(self, dim=-1):
    """swish(A) * B, A the first half of ``dim``, B the second."""
    a, b = self.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(self.dtype)


def _write(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    if slots.dtype != torch.int32:
        raise RuntimeError("reshape_and_cache: slot_indices must be int32")
    nb, bs = cache.shape[:2]
    flat = cache.view(nb * bs, *cache.shape[2:])
    if x.shape[1:] != flat.shape[1:]:
        raise RuntimeError(f"reshape_and_cache: token {tuple(x.shape[1:])} does not fit the "
                           f"cache's {tuple(flat.shape[1:])}")
    flat[slots.long()] = x.to(cache.dtype)


def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    """key / value [T, KVH, D] into caches [num_blocks, block_size, KVH, D] at slots."""
    _write(key_cache, key, slot_indices)
    _write(value_cache, value, slot_indices)


def _npu_reshape_and_cache_siso(key, key_cache, slot_indices):
    """One cache: key [T, N, D] into [num_blocks, block_size, N, D] at slots."""
    _write(key_cache, key, slot_indices)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            visible: torch.Tensor | None) -> torch.Tensor:
    """q [S, N, D], k / v [KV, KVH, D] (GQA: query head h reads kv head h // (N/KVH));
    ``visible`` [S, KV] bool or None -> [S, N, Dv]."""
    n, kvh = q.shape[1], k.shape[1]
    if n % kvh:
        raise RuntimeError("num_heads must be a multiple of num_key_value_heads")
    k = k.float().repeat_interleave(n // kvh, dim=1)
    v = v.float().repeat_interleave(n // kvh, dim=1)
    scores = torch.einsum("snd,knd->nsk", q.float(), k) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
    return torch.einsum("nsk,knd->snd", scores.softmax(-1), v)


def _paged(cache: torch.Tensor, table: torch.Tensor, length: int, kvh: int) -> torch.Tensor:
    """One sequence's first ``length`` tokens of a (blocknum, blocksize, KVH*D) cache."""
    nb, bs, hd = cache.shape
    blocks = table[: math.ceil(length / bs)].long()
    return cache[blocks].reshape(-1, hd)[:length].view(length, kvh, hd // kvh)


def _causal_mask_ok(mask: torch.Tensor | None) -> None:
    if mask is None or tuple(mask.shape[-2:]) != (2048, 2048) or mask.dim() > 4:
        raise RuntimeError("FIA: sparse_mode 2/3/4 needs the optimized (2048, 2048) mask")
    want = torch.ones(2048, 2048, dtype=torch.bool).triu_(1)
    if not torch.equal(mask.reshape(2048, 2048).bool(), want):
        raise RuntimeError("FIA: the sparse_mode 3 mask must be the upper triangle "
                           "(1 = masked)")


def npu_fused_infer_attention_score(query, key, value, *, atten_mask=None,
                                    actual_seq_lengths=None, actual_seq_lengths_kv=None,
                                    block_table=None, num_heads=1, scale=1.0,
                                    input_layout="BSH", num_key_value_heads=0,
                                    sparse_mode=0, block_size=0, softmax_lse_flag=False,
                                    **unused):
    """The layouts pdmesh uses: TND (with or without a paged cache) and BSH with one query
    token per sequence over a paged cache; sparse_mode 0 and 3 (right-down causal)."""
    given = {k for k, v in unused.items() if v is not None and k not in (
        "pre_tokens", "next_tokens", "inner_precise", "antiquant_mode", "key_antiquant_mode",
        "value_antiquant_mode", "query_quant_mode")}
    if given:
        raise NotImplementedError(f"stand-in: FIA with {sorted(given)}")
    kvh = num_key_value_heads or num_heads
    if sparse_mode not in (0, 3):
        raise NotImplementedError(f"stand-in: sparse_mode {sparse_mode}")
    if sparse_mode == 3:
        _causal_mask_ok(atten_mask)
    paged = block_table is not None
    if paged:
        if actual_seq_lengths_kv is None:
            raise RuntimeError("FIA: page attention needs actual_seq_lengths_kv")
        if key.dim() != 3 or key.shape != value.shape:
            raise NotImplementedError("stand-in: the (blocknum, blocksize, H) cache only")
        if key.shape[2] >= 65536:
            raise RuntimeError("FIA: KV_N * D must be < 65536 in (blocknum, blocksize, H)")
        if block_size != key.shape[1]:
            raise RuntimeError("FIA: block_size must be the cache's")
        if block_table.dim() != 2 or block_table.dtype != torch.int32:
            raise RuntimeError("FIA: block_table must be 2-D int32")
    if input_layout == "TND":
        if actual_seq_lengths is None or actual_seq_lengths_kv is None:
            raise RuntimeError("FIA: TND needs actual_seq_lengths and actual_seq_lengths_kv")
        ends = list(actual_seq_lengths)
        if any(b < a for a, b in zip([0, *ends], ends, strict=False)):
            raise RuntimeError("FIA: TND actual_seq_lengths must be cumulative")
        out = torch.empty(query.shape[0], num_heads, value.shape[-1] if not paged
                          else value.shape[-1] // kvh, dtype=query.dtype)
        kv_ends = list(actual_seq_lengths_kv)  # cumulative; paged: each sequence's own
        if len(kv_ends) != len(ends):
            raise RuntimeError("FIA: one kv length per sequence")
        if paged and block_table.shape[0] != len(ends):
            raise RuntimeError("FIA: block_table's first dimension must be the batch")
        start = kv_start = 0
        for b, end in enumerate(ends):
            q = query[start:end]
            if paged:
                kv_len = kv_ends[b]
                k = _paged(key, block_table[b], kv_len, kvh)
                v = _paged(value, block_table[b], kv_len, kvh)
            else:
                kv_len = kv_ends[b] - kv_start
                k, v = key[kv_start:kv_ends[b]], value[kv_start:kv_ends[b]]
                kv_start = kv_ends[b]
            visible = None
            if sparse_mode == 3:
                if kv_len < q.shape[0]:
                    raise RuntimeError("FIA: sparse_mode 3 needs kv length >= q length")
                i = torch.arange(q.shape[0]).unsqueeze(1)
                visible = torch.arange(kv_len).unsqueeze(0) <= kv_len - q.shape[0] + i
            out[start:end] = _attend(q, k, v, scale, visible).to(query.dtype)
            start = end
        return out, torch.zeros(1)
    if input_layout == "BSH":
        b, s, h = query.shape
        if s != 1 or not paged:
            raise NotImplementedError("stand-in: BSH with one query token, paged")
        if block_table.shape[0] != b:
            raise RuntimeError("FIA: block_table's first dimension must be the batch")
        d = h // num_heads
        lens = list(actual_seq_lengths_kv)
        lens = lens * b if len(lens) == 1 else lens[:b]
        out = torch.empty(b, 1, h, dtype=query.dtype)
        for i in range(b):
            q = query[i].view(1, num_heads, d)
            k = _paged(key, block_table[i], lens[i], kvh)
            v = _paged(value, block_table[i], lens[i], kvh)
            out[i] = _attend(q, k, v, scale, None).reshape(1, h).to(query.dtype)
        return out, torch.zeros(1)
    raise NotImplementedError(f"stand-in: input_layout {input_layout!r}")


def _npu_paged_attention_mla(query, key_cache, num_kv_heads, num_heads, scale_value,
                             block_table, context_lens, mla_vheadsize, out):
    """ATB paged attention, MLA mode: query [B, H, L+R] against the latent cache
    [blocknum, blocksize, KVH, L+R] read as keys and, its first mla_vheadsize dims, as
    values; written into out [B, H, mla_vheadsize]."""
    nb, bs, kvh, d = key_cache.shape
    if kvh != num_kv_heads or query.shape[1] != num_heads:
        raise RuntimeError("paged attention (MLA): head counts disagree with the tensors")
    if context_lens.dtype != torch.int32 or block_table.dtype != torch.int32:
        raise RuntimeError("paged attention (MLA): context_lens and block_table are int32")
    flat = key_cache.view(nb, bs, kvh * d)
    for i, n in enumerate(context_lens.tolist()):
        k = _paged(flat, block_table[i], n, kvh)
        o = _attend(query[i].unsqueeze(0), k, k[..., :mla_vheadsize], scale_value, None)
        out[i] = o[0].to(out.dtype)


def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    """softmax over the last axis, then its top k: (y in x's dtype, expert_idx int32,
    row_idx int32)."""
    if not 0 < k <= min(x.shape[-1], 1024):
        raise RuntimeError("npu_moe_gating_top_k_softmax: 0 < k <= experts, k <= 1024")
    y, idx = x.float().softmax(-1).topk(k, dim=-1)
    rows = x.shape[0]
    row_idx = (torch.arange(k).unsqueeze(0) * rows + torch.arange(rows).unsqueeze(1))
    return y.to(x.dtype), idx.to(torch.int32), row_idx.to(torch.int32)


def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1,
                         group_count=1, group_select_mode=0, renorm=0, norm_type=0,
                         out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
    """norm_type 1: sigmoid scores (0: softmax); bias added for the choice only; the
    experts' groups ranked by their largest score (group_select_mode 0) or the sum of
    their top 2 (1), the best k_group kept; the top k of those; y = the chosen unbiased
    scores over their sum + eps, times routed_scaling_factor (renorm 0)."""
    t, e = x.shape
    if renorm != 0:
        raise RuntimeError("npu_moe_gating_top_k: renorm 0 only")
    if bias is not None and bias.dtype != x.dtype:
        raise RuntimeError("npu_moe_gating_top_k: bias must be x's dtype")
    if e % group_count or e // group_count <= 2 or e > 2048:
        raise RuntimeError("npu_moe_gating_top_k: experts split evenly into groups of > 2")
    if k > e // group_count * k_group:
        raise RuntimeError("npu_moe_gating_top_k: k <= experts / group_count * k_group")
    scores = x.float().sigmoid() if norm_type == 1 else x.float().softmax(-1)
    choice = scores + bias.float() if bias is not None else scores
    groups = choice.view(t, group_count, -1)
    rank = (groups.topk(2, dim=-1).values.sum(-1) if group_select_mode == 1
            else groups.max(-1).values)
    keep = torch.zeros_like(rank).scatter_(1, rank.topk(k_group, dim=-1).indices, 1.0)
    masked = choice.masked_fill(~keep.bool().repeat_interleave(e // group_count, 1),
                                float("-inf"))
    idx = masked.topk(k, dim=-1).indices
    y = scores.gather(1, idx)
    y = y / (y.sum(-1, keepdim=True) + eps) * routed_scaling_factor
    return y.to(x.dtype), idx.to(torch.int32), scores.to(x.dtype) if out_flag else \
        torch.empty(0, dtype=x.dtype)


def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None,
                      quant_mode="pertoken", dst_type_max=0.0):
    """Per token (the last axis): scale = max|x| / 127, y = round(x / scale) as int8;
    (y, scale float32 of x's shape without its last axis). float16 / bfloat16 in."""
    if input.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("npu_dynamic_quant: float16 or bfloat16 input")
    if smooth_scales is not None or group_index is not None or quant_mode != "pertoken":
        raise NotImplementedError("stand-in: plain per-token quantization only")
    xf = input.float()
    scale = xf.abs().amax(-1) / 127.0
    y = torch.round(xf / scale.clamp_min(1e-30).unsqueeze(-1)).clamp(-128, 127)
    return y.to(torch.int8), scale


def npu_quantize(self, scales, zero_points, dtype, axis=1, div_mode=True):
    """y = round(x / scales + zero_points) (div_mode false: x * scales), int8 out; scales
    and zero_points along ``axis``."""
    if dtype not in (torch.qint8, torch.int8):
        raise NotImplementedError("stand-in: int8 output only")
    shape = [1] * self.dim()
    shape[axis] = -1
    s, z = scales.float().view(shape), zero_points.float().view(shape)
    q = self.float() / s if div_mode else self.float() * s
    return torch.round(q + z).clamp(-128, 127).to(torch.int8)


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
                     output_dtype=None, **unused):
    """int8 x1 [M, K] @ int8 x2 [K, N] in int32 (+ bias int32 [N]), times scale [N]
    (and pertoken_scale [M]), as output_dtype (int8 when none)."""
    if x1.dtype != torch.int8 or x2.dtype != torch.int8:
        raise RuntimeError("npu_quant_matmul: int8 x1 and x2")
    if offset is not None or any(v is not None for v in unused.values()):
        raise NotImplementedError("stand-in: without offset / group / y_scale")
    acc = x1.long() @ x2.long()
    if bias is not None:
        if bias.dtype != torch.int32:
            raise NotImplementedError("stand-in: an int32 bias only")
        acc = acc + bias.long()
    out = acc.double() * scale.double()
    if pertoken_scale is not None:
        out = out * pertoken_scale.double().unsqueeze(-1)
    return out.to(output_dtype or torch.int8)


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, per_token_scale=None,
                       group_list=None, split_item=0, group_type=None, group_list_type=0,
                       output_dtype=None, **unused):
    """One x [N, K] whose rows run group by group (group_type 0: the m axis), one weight
    [E, K, M]; group_list the groups' sizes (group_list_type 1) or their running ends (0);
    split_item 2 / 3: one output [N, M]. int8 x and weight: (x @ w) * scale[e] [M] *
    per_token_scale [N], as output_dtype."""
    given = {k for k, v in unused.items() if v is not None}
    if len(x) != 1 or len(weight) != 1 or given or bias is not None or offset is not None:
        raise NotImplementedError("stand-in: one x, one weight, no bias / offset")
    if group_type != 0 or split_item not in (2, 3):
        raise NotImplementedError("stand-in: m-axis groups, one output tensor")
    xs, w = x[0], weight[0]
    counts = group_list.long()
    if group_list_type == 0:
        counts = torch.diff(counts, prepend=counts.new_zeros(1))
    if counts.numel() != w.shape[0] or int(counts.sum()) > xs.shape[0]:
        raise RuntimeError("npu_grouped_matmul: group_list does not fit x and weight")
    quant = xs.dtype == torch.int8
    if quant and (scale is None or per_token_scale is None):
        raise RuntimeError("npu_grouped_matmul: int8 needs scale and per_token_scale")
    out_dtype = output_dtype if quant else xs.dtype
    if quant and (scale[0].dtype, out_dtype) not in ((torch.bfloat16, torch.bfloat16),
                                                     (torch.float32, torch.float16)):
        raise RuntimeError("npu_grouped_matmul: per-token int8 takes a bfloat16 scale for "
                           "bfloat16 out, a float32 scale for float16 out")
    out = torch.zeros(xs.shape[0], w.shape[2], dtype=out_dtype or xs.dtype)
    start = 0
    for e, n in enumerate(counts.tolist()):
        rows = xs[start:start + n]
        if quant:
            y = (rows.long() @ w[e].long()).double() * scale[0][e].double()
            y = y * per_token_scale[0][start:start + n].double().unsqueeze(-1)
        else:
            y = rows.float() @ w[e].float()
        out[start:start + n] = y.to(out.dtype)
        start += n
    return [out]


def npu_top_k_top_p(logits, p=None, k=None):
    """The documentation's nine steps: sort ascending, -inf below the k-th largest, then
    below where the ascending cumulative probability is <= 1 - p (the largest kept)."""
    if p is None and k is None:
        raise RuntimeError("npu_top_k_top_p: p and k may not both be None")
    if k is not None and (k.dtype != torch.int32 or int(k.min()) < 1
                          or int(k.max()) > min(1024, logits.shape[1])):
        raise RuntimeError("npu_top_k_top_p: k int32 in [1, 1024] and <= vocab")
    if p is not None and p.dtype != logits.dtype:
        raise RuntimeError("npu_top_k_top_p: p must be logits' dtype")
    value, index = logits.sort(dim=-1, descending=False, stable=True)
    if k is not None:
        kth = value.gather(1, (logits.shape[1] - k.long()).unsqueeze(1))
        value = value.masked_fill(value < kth, float("-inf"))
    if p is not None:
        cum = value.float().softmax(-1).cumsum(-1)
        drop = cum <= (1 - p.float()).unsqueeze(1)
        drop[:, -1] = False
        value = value.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, index, value)


OPS: dict[str, Callable] = {f.__name__: f for f in (
    npu_rms_norm, npu_add_rms_norm, npu_rotary_mul, npu_swiglu, _npu_reshape_and_cache,
    _npu_reshape_and_cache_siso, npu_fused_infer_attention_score, _npu_paged_attention_mla,
    npu_moe_gating_top_k_softmax, npu_moe_gating_top_k, npu_dynamic_quant, npu_quantize,
    npu_quant_matmul, npu_grouped_matmul, npu_top_k_top_p)}


CALLED: dict[str, int] = {}  # op -> its calls, in this process


def _bound(name: str, schemas: list[Schema], fn: Callable) -> Callable:
    """``fn`` behind the binding's check: a call no overload of the op takes is a
    TypeError, as torch_npu's argument parser raises it."""
    def call(*args, **kwargs):
        CALLED[name] = CALLED.get(name, 0) + 1
        why = [s.refuses(len(args), kwargs) for s in schemas]
        if all(why):
            raise TypeError(f"{name}(): {why[0]}")
        schema = schemas[why.index(None)]
        named = [p.name for p in schema.params if not p.keyword_only]
        return fn(**dict(zip(named, args, strict=False)), **kwargs)

    call.__name__ = name
    return call


def module(wheel: Path) -> types.ModuleType:
    """The stand-in torch_npu module: OPS bound to the wheel's schemas."""
    schemas = npu_schemas(wheel)
    mod = types.ModuleType("torch_npu")
    mod.__doc__ = __doc__
    for name, fn in OPS.items():
        setattr(mod, name, _bound(name, schemas[name], fn))
    return mod


def vendored_wheel() -> Path:
    """torch-npu's wheel as `make install` fetched it (scripts/setup.sh)."""
    root = Path(__file__).resolve().parents[3]
    wheels = sorted((root / ".cache" / "vendor").glob("torch_npu-*.whl"))
    if not wheels:
        raise FileNotFoundError("torch-npu's wheel is not in .cache/vendor: run `make "
                                "install` (scripts/setup.sh fetches it)")
    return wheels[-1]


def npu_backend() -> object:
    """shared/kernels/npu.py's NPUBackend on the cpu, its torch_npu this stand-in (the
    module imported afresh with it, then dropped from sys.modules again so nothing else
    imports it by chance)."""
    import importlib
    import sys

    saved = {name: sys.modules.get(name) for name in ("torch_npu",
                                                      "pdmesh.shared.kernels.npu")}
    sys.modules["torch_npu"] = module(vendored_wheel())
    sys.modules.pop("pdmesh.shared.kernels.npu", None)
    try:
        npu = importlib.import_module("pdmesh.shared.kernels.npu")
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
    return npu.NPUBackend(torch.device("cpu"))
