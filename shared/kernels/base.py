"""The one interface every device backend implements.

Each op is written once per backend behind :class:`KernelBackend`. Model code calls
these methods and never branches on the device. Tensor layouts are fixed here and
shared by all backends:

    hidden states      [num_tokens, hidden]              (a flat, varlen batch)
    q                  [num_tokens, num_heads, head_dim]
    k, v               [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache   [num_blocks, block_size, num_kv_heads, head_dim]  (one per layer)

    a paged cache, block_size = 4:
      block_tables[seq] = [7, 2, 9]     seq_len = 10
      slots:  7*4+0 .. 7*4+3 | 2*4+0 .. 2*4+3 | 9*4+0, 9*4+1
              tokens 0..3      tokens 4..7      tokens 8, 9
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pdmesh.shared.kernels.projections import Projections


@dataclass
class AttentionMetadata:
    """What the attention ops need to know about one step's flat batch.

    Sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]`` of q/k/v. Its
    first ``context_lens[i]`` tokens are already in the paged cache; the step adds
    ``query_lens[i]`` more, so it attends over ``seq_lens[i] = context + query`` keys.
    Invariants: ``query_lens >= 1``, ``seq_lens <= block_tables.shape[1] * block_size``.
    Block 0 is the engine's null block (never allocated, kept zero): block tables are
    padded with it, and a backend may point any padded read there.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, on device
    seq_lens: torch.Tensor  # [num_seqs] int32, on device
    context_lens: torch.Tensor  # [num_seqs] int32, on device
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, on device
    query_lens_host: list[int]
    seq_lens_host: list[int]
    context_lens_host: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # block_tables as built on the host (numpy, int32), so backends need no device read
    block_tables_host: Any = None
    # the other cache groups' block tables (DeepSeek-V4's sliding window), host side
    group_tables_host: list[Any] = field(default_factory=list)
    positions_host: Any = None  # [num_tokens] int64 numpy: each row's position
    # What a backend precomputes once per step and reuses in every layer.
    backend_state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token this step."""
        return self.max_query_len == 1

    @property
    def has_context(self) -> bool:
        """Some sequence attends to tokens computed in an earlier step."""
        return max(self.context_lens_host, default=0) > 0


class KernelBackend(Projections, ABC):
    """Device kernels. Subclasses override what their device does better.

    The defaults below are plain, vectorized torch and are correct on any device;
    the attention ops are abstract because each device pages differently.
    """

    name: str = "base"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    # -- per step ---------------------------------------------------------------------
    def prepare_attention(self, meta: AttentionMetadata) -> None:  # noqa: B027 (optional hook)
        """Precompute, once per step, whatever the attention ops reuse in every layer."""

    # -- normalization ----------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim, statistics in float32 (as Hugging Face computes it)."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(rms_norm(x + residual), x + residual)``."""
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    # -- position ---------------------------------------------------------------------
    def head_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each head's vector, scaled by that head's weight.

        x [T, N, D], weight [N, D] (e.g. q_norm repeated over the query heads, then k_norm
        over the KV heads: Qwen3's q/k norm in one call).
        """
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    # -- position ---------------------------------------------------------------------
    def rotary_tables(
        self, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Turn the model's [max_pos, D] cos/sin tables into the form this backend's
        ``rotary_embedding`` takes (called once, at load). Default: unchanged."""
        return cos, sin

    def rotary_embedding(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Neox-style (rotate-half) rotary embedding of every head of x.

        x [T, N, D] (query and key heads side by side); cos/sin [T, D] are the rows, for
        the tokens' positions, of the tables ``rotary_tables`` returned -> [T, N, D]:
        x * cos + cat(-x2, x1) * sin.
        """
        cos = cos.unsqueeze(1).to(x.dtype)  # [T, 1, D]
        sin = sin.unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return torch.addcmul(x * cos, rotated, sin)

    # -- KV cache and attention -------------------------------------------------------
    def write_cache(self, x: torch.Tensor, cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
        """Scatter x [T, N, D] into its slots of one paged cache [blocks, bs, N, D] (MLA's
        latent cache: one "head" of kv_lora_rank + rope dims per token)."""
        num_blocks, block_size, n, d = cache.shape
        cache.view(num_blocks * block_size, n, d).index_copy_(0, slot_mapping, x)

    def write_kv_cache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatter k/v [T, KVH, D] into their slots of the paged caches."""
        num_blocks, block_size, kvh, d = k_cache.shape
        k_cache.view(num_blocks * block_size, kvh, d).index_copy_(0, slot_mapping, k)
        v_cache.view(num_blocks * block_size, kvh, d).index_copy_(0, slot_mapping, v)

    # -- int8 KV cache (--kv-cache-dtype int8) -----------------------------------------
    def quantize_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, N, D] -> (int8 [T, N, D], float32 scale [T, N, 1]): symmetric per token
        and head, scale = max|x| / 127."""
        xf = x.float()
        scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
        return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale

    def write_int8_cache(self, x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
        """x [T, N, D] quantized into its slots of an int8 cache and its scales
        [blocks, bs, N, 1]."""
        q, s = self.quantize_kv(x)
        self.write_cache(q, cache, slot_mapping)
        self.write_cache(s, scales, slot_mapping)

    def int8_cache_view(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                        meta: AttentionMetadata, dtype: torch.dtype
                        ) -> tuple[list[torch.Tensor], AttentionMetadata]:
        """The blocks this step reads of int8 caches (each with its scales), dequantized
        to ``dtype`` into compact caches, and the step's metadata renumbered to them: any
        attention op then runs as on a float cache. The renumbering is built once a step
        (every layer shares the block tables); the dequantized blocks once a layer."""
        state = meta.backend_state
        if "int8_view" not in state:
            state["int8_view"] = self._renumbered(meta)
        ids, sub = state["int8_view"]
        out = []
        for cache, scales in pairs:
            rows = cache.index_select(0, ids).to(dtype)
            out.append(rows.mul_(scales.index_select(0, ids).to(dtype)))
        return out, sub

    def paged_attention_decode_int8(
        self, q: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor],
        scales: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """paged_attention_decode over int8 caches (k, v) with their scales: here through
        dequantized views of the blocks read; a backend may read them in place."""
        (k_cache, v_cache), sub = self.int8_cache_view(list(zip(caches, scales, strict=True)),
                                                       meta, q.dtype)
        return self.paged_attention_decode(q, k_cache, v_cache, sub, scale)

    def paged_attention_prefill_int8(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        caches: tuple[torch.Tensor, torch.Tensor], scales: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """paged_attention_prefill over int8 caches (k, v) with their scales (this step's
        k / v written to them already): here through dequantized views of the blocks
        read; a backend may read them in place."""
        (k_cache, v_cache), sub = self.int8_cache_view(list(zip(caches, scales, strict=True)),
                                                       meta, q.dtype)
        return self.paged_attention_prefill(q, k, v, k_cache, v_cache, sub, scale)

    def latent_attention_prefill_int8(
        self, q: torch.Tensor, entry: torch.Tensor, cache: torch.Tensor,
        cache_scale: torch.Tensor, meta: AttentionMetadata, scale: float, value_dim: int,
    ) -> torch.Tensor:
        """latent_attention_prefill over an int8 latent cache and its scales."""
        (view,), sub = self.int8_cache_view([(cache, cache_scale)], meta, q.dtype)
        return self.latent_attention_prefill(q, entry, view, sub, scale, value_dim)

    def latent_attention_decode_int8(
        self, q: torch.Tensor, cache: torch.Tensor, cache_scale: torch.Tensor,
        meta: AttentionMetadata, scale: float, value_dim: int,
    ) -> torch.Tensor:
        """latent_attention_decode over an int8 latent cache and its scales."""
        (view,), sub = self.int8_cache_view([(cache, cache_scale)], meta, q.dtype)
        return self.latent_attention_decode(q, view, sub, scale, value_dim)

    def _renumbered(self, meta: AttentionMetadata) -> tuple[torch.Tensor, AttentionMetadata]:
        import numpy as np

        tables = meta.block_tables_host
        if tables is None:
            tables = meta.block_tables.cpu().numpy()
        ids = np.union1d(np.zeros(1, dtype=np.int64), tables.astype(np.int64))  # 0 first
        remap = np.zeros(int(ids[-1]) + 1, dtype=np.int32)
        remap[ids] = np.arange(len(ids), dtype=np.int32)
        new_tables = np.ascontiguousarray(remap[tables])
        bs = meta.block_size
        slots = meta.slot_mapping.cpu().numpy()
        new_slots = remap[slots // bs].astype(np.int64) * bs + slots % bs
        dev = meta.block_tables.device
        sub = AttentionMetadata(
            slot_mapping=torch.from_numpy(new_slots).to(dev),
            query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
            context_lens=meta.context_lens,
            block_tables=torch.from_numpy(new_tables).to(dev),
            query_lens_host=meta.query_lens_host, seq_lens_host=meta.seq_lens_host,
            context_lens_host=meta.context_lens_host, max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len, block_size=bs, block_tables_host=new_tables,
            group_tables_host=meta.group_tables_host, positions_host=meta.positions_host,
            # the views are new tensors every layer: nothing may be carried across steps
            backend_state={"transient_caches": True})
        self.prepare_attention(sub)
        return torch.from_numpy(ids).to(dev), sub

    @abstractmethod
    def paged_attention_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention for a varlen batch of chunks; q [T, H, D] -> [T, H, D].

        k/v are this step's keys/values, already written to the caches; a backend may
        use them directly when no sequence has earlier context.
        """

    @abstractmethod
    def paged_attention_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """One new token per sequence; q [B, H, D] -> [B, H, D]."""

    # -- MLA over the latent cache -------------------------------------------------------
    def latent_attention_prefill(
        self, q: torch.Tensor, entry: torch.Tensor, cache: torch.Tensor,
        meta: AttentionMetadata, scale: float, value_dim: int,
    ) -> torch.Tensor:
        """MLA, absorbed: q [T, H, L + R] (each head's query folded into the latent space,
        and its rope dims) over one shared "head" per token, cache [blocks, bs, 1, L + R]
        (the latent and the rope key; this step's ``entry`` [T, 1, L + R] already written).
        The values are the latents, each entry's first ``value_dim`` (= L) dims.
        -> [T, H, value_dim]. Causal, paged, as paged_attention_prefill."""
        return self.paged_attention_prefill(q, entry, entry, cache, cache, meta,
                                            scale)[..., :value_dim]

    def latent_attention_decode(
        self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        value_dim: int,
    ) -> torch.Tensor:
        """One new token per sequence: q [B, H, L + R] -> [B, H, value_dim]."""
        return self.paged_attention_decode(q, cache, cache, meta, scale)[..., :value_dim]

    # -- MLP and MoE ------------------------------------------------------------------
    def silu_and_mul(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]. x is a temporary of the
        caller's and may be overwritten (the result may be a view of it). ``limit``
        (DeepSeek-V4's swiglu_limit): gate clamped to at most limit, up to +-limit."""
        gate, up = x.chunk(2, dim=-1)
        if limit:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return F.silu(gate) * up

    def moe_gating_topk(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax over experts (float32), top-k, optional renormalization.

        router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64).
        """
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def moe_gating_grouped_topk(
        self, router_logits: torch.Tensor, top_k: int, num_groups: int, topk_groups: int,
        correction_bias: torch.Tensor | None, renormalize: bool, scaling: float,
        scoring: str = "sigmoid",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's routing (noaux_tc): sigmoid scores; experts are chosen by score
        plus ``correction_bias``, only within the ``topk_groups`` groups whose two best
        biased scores sum highest; their weights are the unbiased scores, renormalized
        (optionally), times ``scaling``. DeepSeek-V4 scores with ``sqrtsoftplus``
        (sqrt(softplus(logit))), or ``softmax``, the same way otherwise.

        router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64).
        """
        scores = score_experts(router_logits, scoring)
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if num_groups > 1:
            t, e = choice.shape
            grouped = choice.view(t, num_groups, e // num_groups)
            group_scores = grouped.topk(min(2, e // num_groups), dim=-1)[0].sum(dim=-1)
            keep = torch.zeros_like(group_scores).scatter_(
                1, group_scores.topk(topk_groups, dim=-1)[1], 1.0).bool()  # [T, G]
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
        ids = choice.topk(top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * scaling, ids

    # -- DeepSeek-V4 hyper-connections -------------------------------------------------
    def hc_sinkhorn(self, comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        """Sinkhorn-Knopp on positive matrices comb [T, n, n] (float32): normalise the
        columns, then ``iters - 1`` rounds of rows and columns, each x / (sum + eps).
        May work in place; returns the result."""
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + eps)
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
        return comb

    # -- DeepSeek-V4 attention -------------------------------------------------------
    def sink_attention(
        self, q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Attention of many query heads over one shared K=V head, with a learned sink
        per head (a logit that joins the softmax and carries no value).

        q [S, H, Lq, D], kv [S, K, D] (each sequence's keys, which are its values),
        visible [S, Lq, K] bool, sinks [H] float32 -> [S, H, Lq, D]. A row that sees no
        key gives zeros (all its weight goes to the sink).
        """
        s, h, lq, d = q.shape
        k = kv.shape[1]
        out = q.new_empty((s, h, lq, d))
        sink = sinks.float().view(1, h, 1, 1)
        # bound the logits temporary: query rows in pieces of at most ~32M logits
        step = max(1, (1 << 25) // max(1, s * h * k))
        for lo in range(0, lq, step):
            hi = min(lq, lo + step)
            logits = torch.matmul(q[:, :, lo:hi], kv.transpose(1, 2).unsqueeze(1)).float()
            logits = logits.mul_(scale).masked_fill_(~visible[:, None, lo:hi], float("-inf"))
            top = torch.maximum(logits.amax(-1, keepdim=True), sink)
            probs = (logits - top).exp_()
            denom = probs.sum(-1, keepdim=True) + (sink - top).exp()
            probs = probs.div_(denom).to(q.dtype)
            out[:, :, lo:hi] = torch.matmul(probs, kv.unsqueeze(1))
        return out

    def sink_attention_decode(
        self, q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor | None,
                                                   torch.Tensor, torch.Tensor]],
        sinks: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        """``sink_attention`` for one query token per sequence over keys listed by their
        cache rows: q [S, H, D]; each source (cache [..., D] as rows, its int8 scales
        [..., 1] or None, slots [S, K] flat row ids, visible [S, K] bool), the keys of a
        sequence those of every source in turn -> [S, H, D]. Here: the rows gathered."""
        keys, seen = [], []
        for cache, scales, slots, visible in sources:
            rows = cache.reshape(-1, cache.shape[-1]).index_select(0, slots.reshape(-1))
            rows = rows.view(*slots.shape, cache.shape[-1]).to(q.dtype)
            if scales is not None:
                rows = rows * scales.reshape(-1).index_select(
                    0, slots.reshape(-1)).view(*slots.shape, 1).to(q.dtype)
            keys.append(rows)
            seen.append(visible)
        return self.sink_attention(q.unsqueeze(2), torch.cat(keys, 1),
                                   torch.cat(seen, -1).unsqueeze(1), sinks, scale)[:, :, 0]

    # -- sampling ---------------------------------------------------------------------
    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Argmax token of each row of logits [B, V] -> [B] int64."""
        return logits.argmax(dim=-1)

    def top_k_top_p(
        self, logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
    ) -> torch.Tensor:
        """Mask logits [B, V] outside each row's top-k and nucleus top-p with -inf.

        top_k [B] int64 (V or more means off); top_p [B] float32 (1.0 means off).
        """
        if top_k is None and top_p is None:
            return logits
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
        vocab = logits.shape[-1]
        if top_k is not None:
            kth = (vocab - top_k.clamp(1, vocab)).unsqueeze(1)  # index of k-th largest
            threshold = sorted_logits.gather(1, kth)
            sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
        if top_p is not None:
            probs = sorted_logits.softmax(dim=-1)
            cum = probs.cumsum(dim=-1)
            drop = cum <= (1.0 - top_p.unsqueeze(1))
            drop[:, -1] = False  # always keep the most likely token
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)

    def random_sample(
        self, probs: torch.Tensor, generators: dict[int, torch.Generator]
    ) -> torch.Tensor:
        """Sample one token per row of probs [B, V] by the exponential race.

        argmax(p / E) with E ~ Exp(1) draws from p; rows in ``generators`` draw their
        noise from their own seeded generator so they reproduce exactly.
        """
        noise = torch.empty_like(probs)
        if len(generators) < probs.shape[0]:
            noise.exponential_()
        for row, gen in generators.items():
            if gen.device == probs.device:
                noise[row].exponential_(generator=gen)
            else:  # a host generator seeds a device row: draw on the host, copy over
                noise[row] = torch.empty(probs.shape[1]).exponential_(generator=gen)
        return probs.div(noise).argmax(dim=-1)



def score_experts(router_logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Router logits [T, E] -> float32 expert scores: sigmoid, softmax or DeepSeek-V4's
    sqrtsoftplus."""
    x = router_logits.float()
    if scoring == "sigmoid":
        return x.sigmoid()
    if scoring == "sqrtsoftplus":
        return F.softplus(x).sqrt()
    if scoring == "softmax":
        return x.softmax(dim=-1)
    raise ValueError(f"scoring_func: {scoring!r} is not supported")
