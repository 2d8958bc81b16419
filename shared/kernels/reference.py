"""Plain reference implementations, written for clarity, not speed.

The conformance suite checks every backend present against these: attention is computed
one sequence at a time from the block table with an explicit softmax, MoE one token at a
time, top-k/top-p one row at a time. Nothing here is on a serving path.
"""

from __future__ import annotations

import torch

from pdmesh.shared.kernels.base import AttentionMetadata
from pdmesh.shared.kernels.quant import DYNAMIC, QuantLinear, quantize_weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.double()
    y = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps)
    return (weight.double() * y).to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, N, D], cos/sin [T, D]: x*cos + rotate_half(x)*sin, rotate_half = (-x2, x1)."""
    d = x.shape[-1] // 2
    xd = x.double()
    rot = torch.cat((-xd[..., d:], xd[..., :d]), dim=-1)
    return (xd * cos.double()[:, None] + rot * sin.double()[:, None]).to(x.dtype)


def gather_sequence(cache: torch.Tensor, block_table: list[int], length: int) -> torch.Tensor:
    """[num_blocks, bs, KVH, D] -> the sequence's first ``length`` tokens, [length, KVH, D]."""
    bs = cache.shape[1]
    rows = [cache[block_table[j // bs], j % bs] for j in range(length)]
    return torch.stack(rows)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys; q [T, H, D]."""
    out = torch.empty_like(q)
    h = q.shape[1]
    kvh = k_cache.shape[2]
    tables = meta.block_tables.tolist()
    starts = meta.query_start_loc.tolist()
    for i in range(meta.num_seqs):
        seq_len, ctx = meta.seq_lens_host[i], meta.context_lens_host[i]
        k = gather_sequence(k_cache, tables[i], seq_len).double()  # [L, KVH, D]
        v = gather_sequence(v_cache, tables[i], seq_len).double()
        k = k.repeat_interleave(h // kvh, dim=1)
        v = v.repeat_interleave(h // kvh, dim=1)
        for t in range(starts[i], starts[i + 1]):
            pos = ctx + (t - starts[i])  # this query's position; it sees keys 0..pos
            scores = torch.einsum("hd,lhd->hl", q[t].double(), k[: pos + 1]) * scale
            probs = torch.softmax(scores, dim=-1)
            out[t] = torch.einsum("hl,lhd->hd", probs, v[: pos + 1]).to(q.dtype)
    return out


def paged_batch(ctx_lens: list[int], q_lens: list[int], block_size: int, *, kvh: int = 2,
                h: int = 8, d: int = 64, dtype: torch.dtype = torch.float32,
                generator: torch.Generator | None = None, consecutive: bool = False
                ) -> tuple[torch.Tensor, ...]:
    """A random paged batch, as the engine lays one out: caches [blocks, bs, kvh, d]
    holding every sequence's context (its blocks scattered unless ``consecutive``, as a
    lone request's often are; block 0 the null block, zero; two blocks spare), each
    sequence's new q [T, h, d] and k / v [T, kvh, d], and the metadata (host fields
    filled, block tables padded with the null block). -> (q, k, v, k_cache, v_cache,
    meta)."""
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    per = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per) + 3
    ids = (list(range(1, num_blocks)) if consecutive
           else (torch.randperm(num_blocks - 1, generator=g) + 1).tolist())
    tables, at = [], 0
    for n in per:
        tables.append(ids[at:at + n])
        at += n
    table = torch.zeros(len(seq_lens), max(per), dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    shape = (num_blocks, block_size, kvh, d)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    k_cache[0], v_cache[0] = 0, 0
    slots = [t[p // block_size] * block_size + p % block_size
             for t, c, n in zip(tables, ctx_lens, q_lens, strict=True) for p in range(c, c + n)]
    total = sum(q_lens)
    q = torch.randn(total, h, d, generator=g).to(dtype)
    k, v = (torch.randn(total, kvh, d, generator=g).to(dtype) for _ in range(2))
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long), query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32), block_tables=table,
        query_lens_host=list(q_lens), seq_lens_host=seq_lens, context_lens_host=list(ctx_lens),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), block_size=block_size)
    return q, k, v, k_cache, v_cache, meta


def silu_and_mul(x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    d = x.shape[-1] // 2
    g, u = x[..., :d].double(), x[..., d:].double()
    if limit:
        g, u = torch.clamp(g, max=limit), torch.clamp(u, -limit, limit)
    return (g * torch.sigmoid(g) * u).to(x.dtype)


def moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
        ids: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            hcat = w13[e].double() @ x[t].double()
            h = silu_and_mul(hcat, limit)
            out[t] += float(weights[t, j]) * (w2[e].double() @ h)
    return out.to(x.dtype)


def top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Row by row: keep the k largest, then the smallest set of the largest whose
    probability reaches p (ties at the boundary kept)."""
    out = torch.full_like(logits, float("-inf"))
    for i in range(logits.shape[0]):
        row = logits[i]
        order = torch.argsort(row, descending=True)
        keep = order[: top_k[i]]
        probs = torch.softmax(row[keep].double(), dim=-1)
        cum = 0.0
        n = 0
        for p in probs.tolist():
            n += 1
            cum += p
            if cum >= top_p[i] - 1e-9:
                break
        keep = keep[:n]
        out[i, keep] = row[keep]
    return out


def grouped_topk(logits: torch.Tensor, top_k: int, num_groups: int, topk_groups: int,
                 bias: torch.Tensor, renormalize: bool, scaling: float,
                 scoring: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing, one token at a time in float64: groups ranked by their two
    best biased scores; the best biased experts of the best groups; unbiased weights.
    DeepSeek-V4 scores sqrt(softplus(logit)) (or softmax) instead of the sigmoid."""
    x = logits.double()
    if scoring == "sqrtsoftplus":
        scores = torch.sqrt(torch.log1p(torch.exp(x)))
    elif scoring == "softmax":
        scores = torch.exp(x) / torch.exp(x).sum(-1, keepdim=True)
    else:
        scores = 1 / (1 + torch.exp(-x))
    biased = scores + bias.double()
    per = logits.shape[1] // num_groups
    weights, ids = [], []
    for t in range(logits.shape[0]):
        groups = biased[t].view(num_groups, per)
        rank = groups.topk(min(2, per), dim=-1)[0].sum(-1).topk(topk_groups)[1].tolist()
        allowed = [g * per + j for g in sorted(rank) for j in range(per)]
        best = sorted(allowed, key=lambda e: -float(biased[t, e]))[:top_k]
        w = scores[t, best]
        if renormalize:
            w = w / w.sum()
        weights.append(w * scaling)
        ids.append(best)
    return torch.stack(weights), torch.tensor(ids)


def sink_attention(q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor,
                   sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [S, H, Lq, D] over kv [S, K, D] (keys = values) where visible [S, Lq, K], with
    a sink logit per head in the softmax denominator; one query at a time, float64."""
    s_, h_, lq, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(s_):
        keys = kv[s].double()
        for i in range(lq):
            seen = visible[s, i].nonzero().flatten()
            for h in range(h_):
                logits = [float(q[s, h, i].double() @ keys[j]) * scale for j in seen]
                top = max([float(sinks[h]), *logits])
                weights = [2.718281828459045 ** (x - top) for x in logits]
                total = sum(weights) + 2.718281828459045 ** (float(sinks[h]) - top)
                for w, j in zip(weights, seen, strict=True):
                    out[s, h, i] += w / total * keys[j]
    return out.to(q.dtype)


def hc_sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp on each n x n matrix, element by element, float64: columns, then
    ``iters - 1`` rounds of rows and columns, each x / (sum + eps)."""
    out = comb.double().clone()
    n = out.shape[-1]
    for m in out:
        for it in range(2 * iters - 1):
            by_rows = it % 2 == 1
            for i in range(n):
                line = [(i, j) if by_rows else (j, i) for j in range(n)]
                total = sum(float(m[a, b]) for a, b in line) + eps
                for a, b in line:
                    m[a, b] = float(m[a, b]) / total
    return out


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor
                ) -> torch.Tensor:
    """W8A8_DYNAMIC from its definition, float64 (``quant_linear``)."""
    return quant_linear(x, QuantLinear("w8a8_dynamic", qweight, weight_scale))


def quant_linear(x: torch.Tensor, w: QuantLinear,
                 scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    """What ``KernelBackend.linear`` computes for a QuantLinear, from the definitions in
    ``quant``'s docstring (no integer kernels): the activations quantized in float32, as
    the NPU ops define it (dynamic: each row by scale = row_max(|x|) / 127, q =
    round(x / scale); static W8A8: each run of columns by round(x * (1 / input_scale) +
    input_offset)), the products and scales in float64. ``scale_dtype``: the dtype the
    static path's 1 / input_scale is held in (the npu's: x's, as vLLM-Ascend holds it;
    None: exact)."""
    xf = x.float()
    qw = w.weight.double()
    if w.scheme in DYNAMIC:
        s = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0
        qx = torch.round(xf / s).clamp(-127, 127).double()
        acc = qx @ qw
        if w.offset is not None:
            acc = acc - qx.sum(-1, keepdim=True) * w.offset.double()
        return (acc * s.double() * w.scale.double()).to(x.dtype)
    assert w.deq_scale is not None and w.quant_bias is not None
    outs = []
    for a, b, scale, offset in w.runs():
        inv = 1.0 / scale if scale_dtype is None else float(
            torch.tensor(1.0 / scale, dtype=scale_dtype))
        qx = torch.round(xf * inv + offset).clamp(-128, 127).double()
        outs.append((qx @ qw[:, a:b] + w.quant_bias[a:b].double()) * w.deq_scale[a:b].double())
    return torch.cat(outs, dim=-1).to(x.dtype)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [K, N] (input-major) -> (int8 [K, N], scale [N] float32), symmetric
    per output channel: w ~ q * scale."""
    q, scale = quantize_weight(w.t(), "w8a8_dynamic")
    return q.t().contiguous(), scale
