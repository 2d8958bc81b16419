"""Ascend NPU backend: the kernel ops mapped onto torch_npu's fused operators.

Every op keeps base.py's semantics and layouts; where an input falls outside an operator's
documented constraints (dtype, head_dim, block_size, ...) the op falls back to the
device-generic torch path (``super()``, or CPUBackend's vectorized attention, which runs on
any device). Paged attention goes through ``npu_fused_infer_attention_score`` (FIA):

    prefill  q [T, H, D] as TND, causal by sparse_mode=3 with the fixed 2048x2048 mask,
             actual_seq_lengths = cumulative query lengths; k/v from this step when no
             sequence has context, else the paged cache + block_table (actual_seq_lengths_kv
             = per-sequence kv lengths, as vllm-ascend passes them)
    decode   q [B, 1, H*D] as BSH (Q_S = 1), paged cache + block_table

Sources: op-plugin docs (Ascend/op-plugin docs/context/torch_npu-*.md, hiascend.com API
reference) and vllm-ascend (vllm_ascend/attention/attention_v1.py, attention_mask.py,
ops/fused_moe/moe_mlp.py, sample/sampler.py). UNVERIFIED ON HARDWARE: written from the
documentation only, no NPU was available when this file was written.
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch_npu

from shared.kernels.base import AttentionMetadata, KernelBackend
from shared.kernels.cpu import CPUBackend

_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_FIA_MASK_SIZE = 2048  # sparse_mode 2/3/4 take a fixed (2048, 2048) mask (FIA doc)
_INNER_LIMIT = 65536  # npu_grouped_matmul: last dim of x / weight must be < 65536
_MAX_GROUPS = 1024  # npu_grouped_matmul single-tensor group_list: at most 1024 groups
_TOPK_MAX = 1024  # npu_top_k_top_p: k in [1, 1024]; npu_moe_gating_top_k_softmax: k <= 1024
_HAS_RESHAPE_AND_CACHE = hasattr(torch_npu, "_npu_reshape_and_cache")
_HAS_TOP_K_TOP_P = hasattr(torch_npu, "npu_top_k_top_p")


class NPUBackend(KernelBackend):
    name = "npu"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._torch = CPUBackend(device)  # device-generic torch attention, for fallbacks
        self._causal_mask: torch.Tensor | None = None

    # -- per step ---------------------------------------------------------------------
    def prepare_attention(self, meta: AttentionMetadata) -> None:
        state = meta.backend_state
        # FIA: block_table int32 [B, max_blocks]; actual_seq_lengths* are host int lists.
        state["npu_block_table"] = meta.block_tables.to(torch.int32)
        state["npu_kv_lens"] = list(meta.seq_lens_host)  # per sequence
        state["npu_cu_q"] = list(accumulate(meta.query_lens_host))  # TND: cumulative
        if not meta.is_decode:
            state["npu_mask"] = self._fia_causal_mask()

    def _fia_causal_mask(self) -> torch.Tensor:
        """Upper-triangular int8 [2048, 2048] (1 = masked) for sparse_mode=3.

        vllm-ascend attention_mask.py get_splitfuse_attn_mask builds exactly this.
        """
        if self._causal_mask is None:
            ones = torch.ones(_FIA_MASK_SIZE, _FIA_MASK_SIZE, dtype=torch.bool)
            self._causal_mask = ones.triu_(1).to(dtype=torch.int8, device=self.device)
        return self._causal_mask

    def _fallback(self, meta: AttentionMetadata) -> CPUBackend:
        """CPUBackend's attention (plain torch, any device), its step state built lazily."""
        if "key_slots" not in meta.backend_state:
            self._torch.prepare_attention(meta)
        return self._torch

    # -- normalization ----------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # npu_rms_norm(self, gamma, epsilon=1e-6) -> (y, rstd); fp16/bf16/fp32, gamma's
        # dtype must equal x's (op-plugin doc torch_npu-npu_rms_norm / hiascend ptaoplist).
        if x.dtype not in _FLOATS or weight.dtype != x.dtype:
            return super().rms_norm(x, weight, eps)
        return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6) -> (y, rstd, x1 + x2); x1, x2, gamma
        # share one dtype (op-plugin test_npu_add_rms_norm.py; vllm-ascend layernorm.py).
        if x.dtype not in _FLOATS or not (residual.dtype == weight.dtype == x.dtype):
            return super().add_rms_norm(x, residual, weight, eps)
        y, _, summed = torch_npu.npu_add_rms_norm(x, residual, weight, eps)
        return y, summed

    # -- position ---------------------------------------------------------------------
    def rotary_embedding(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # npu_rotary_mul(input, r1, r2, rotary_mode='half'): out = r1*x + r2*cat(-x2, x1),
        # the rotate-half form of base._rope. 4-D input; BSND takes r1/r2 as 1S1D; D even
        # and < 896; B, N < 1000 (op-plugin doc torch_npu-npu_rotary_mul.md).
        t, h, d = q.shape
        kvh = k.shape[1]
        if (q.dtype not in _FLOATS or k.dtype != q.dtype or t == 0 or d % 2 or d >= 896
                or max(h, kvh) >= 1000):
            return super().rotary_embedding(q, k, cos, sin)
        r1 = cos.to(q.dtype).reshape(1, t, 1, d)  # [1, T, 1, D]
        r2 = sin.to(q.dtype).reshape(1, t, 1, d)
        q_out = torch_npu.npu_rotary_mul(q.contiguous().unsqueeze(0), r1, r2)  # [1, T, H, D]
        k_out = torch_npu.npu_rotary_mul(k.contiguous().unsqueeze(0), r1, r2)  # [1, T, KVH, D]
        return q_out[0], k_out[0]

    # -- KV cache and attention -------------------------------------------------------
    def write_kv_cache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        # torch_npu._npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
        # k/v [T, KVH, D] into caches [num_blocks, block_size, KVH, D], int32 slots
        # (vllm-ascend attention_v1.py / device_op.py). Passed positionally: the slot
        # keyword was renamed across CANN releases. Private op, fp16/bf16 caches only here.
        if not _HAS_RESHAPE_AND_CACHE or k.dtype not in _HALF or k_cache.dtype != k.dtype:
            super().write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
            return
        torch_npu._npu_reshape_and_cache(
            k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping.to(torch.int32)
        )

    @staticmethod
    def _fia_ok(q: torch.Tensor, kv_dtype: torch.dtype, num_kv_heads: int) -> bool:
        """npu_fused_infer_attention_score input constraints (op-plugin FIA doc).

        query fp16/bf16 (key/value the same); N <= 256; D <= 512 and 16-aligned for
        fp16/bf16 when Q_S > 1; num_heads a multiple of num_key_value_heads, ratio <= 64.
        """
        _, h, d = q.shape
        return (q.dtype in _HALF and kv_dtype == q.dtype and h <= 256 and d <= 512
                and d % 16 == 0 and h % num_kv_heads == 0 and h // num_kv_heads <= 64)

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
        t, h, d = q.shape
        num_blocks, bs, kvh, _ = k_cache.shape
        state = meta.backend_state
        # TND: T <= 1M (FIA doc).
        if not self._fia_ok(q, k_cache.dtype, kvh) or t > (1 << 20):
            return self._fallback(meta).paged_attention_prefill(
                q, k, v, k_cache, v_cache, meta, scale)
        if not meta.has_context:
            # Fresh prompts: attend over this step's k/v [T, KVH, D], TND on both sides with
            # cumulative kv lengths (vllm-ascend attention_v1.py _get_fia_params,
            # PrefillNoCache: block_table=None, actual_seq_lengths_kv=actual_seq_lengths_q).
            out, _ = torch_npu.npu_fused_infer_attention_score(
                q.contiguous(), k.contiguous(), v.contiguous(),
                atten_mask=state["npu_mask"],
                actual_seq_lengths=state["npu_cu_q"],
                actual_seq_lengths_kv=state["npu_cu_q"],
                num_heads=h, num_key_value_heads=kvh, scale=scale,
                input_layout="TND", sparse_mode=3,
            )
            return out  # [T, H, D]
        # Page attention with Q_S > 1: block_size a multiple of 128 in [128, 512]; the
        # (num_blocks, block_size, KVH*D) cache layout needs KVH*D < 65536 (FIA doc).
        if bs % 128 or not 128 <= bs <= 512 or kvh * d >= _INNER_LIMIT:
            return self._fallback(meta).paged_attention_prefill(
                q, k, v, k_cache, v_cache, meta, scale)
        # sparse_mode=3 is right-down causal: query i of a sequence with q_len queries and
        # kv_len keys sees keys j <= kv_len - q_len + i, i.e. context + i, as base.py wants
        # (vllm-ascend attention_v1.py forward_fused_infer_attention, chunked prefill).
        out, _ = torch_npu.npu_fused_infer_attention_score(
            q.contiguous(),
            k_cache.view(num_blocks, bs, kvh * d),  # [num_blocks, block_size, KVH*D]
            v_cache.view(num_blocks, bs, kvh * d),
            atten_mask=state["npu_mask"],
            block_table=state["npu_block_table"],
            actual_seq_lengths=state["npu_cu_q"],
            actual_seq_lengths_kv=state["npu_kv_lens"],
            num_heads=h, num_key_value_heads=kvh, scale=scale,
            input_layout="TND", sparse_mode=3, block_size=bs,
        )
        return out  # [T, H, D]

    def paged_attention_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        b, h, d = q.shape
        num_blocks, bs, kvh, _ = k_cache.shape
        # Q_S = 1 page attention: fp16/bf16 cache needs block_size 16-aligned; the
        # (num_blocks, block_size, KVH*D) layout needs KVH*D < 64k (FIA doc, "Q_S等于1").
        if not self._fia_ok(q, k_cache.dtype, kvh) or bs % 16 or kvh * d >= _INNER_LIMIT:
            return self._fallback(meta).paged_attention_decode(q, k_cache, v_cache, meta, scale)
        # BSH with S = 1 takes the IncreFlashAttention branch; sparse_mode and
        # actual_seq_lengths are ignored there (vllm-ascend attention_v1.py
        # _forward_fia_slidingwindow makes the same call, minus pre_tokens).
        out, _ = torch_npu.npu_fused_infer_attention_score(
            q.contiguous().view(b, 1, h * d),  # [B, 1, H*D]
            k_cache.view(num_blocks, bs, kvh * d),  # [num_blocks, block_size, KVH*D]
            v_cache.view(num_blocks, bs, kvh * d),
            block_table=meta.backend_state["npu_block_table"],
            actual_seq_lengths_kv=meta.backend_state["npu_kv_lens"],
            num_heads=h, num_key_value_heads=kvh, scale=scale,
            input_layout="BSH", block_size=bs,
        )
        return out.view(b, h, d)

    # -- MLP and MoE ------------------------------------------------------------------
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        # npu_swiglu(input, dim=-1) = swish(A) * B with A the FIRST half (the gate), as in
        # base.py; fp16/bf16/fp32, contiguous, non-empty (op-plugin doc torch_npu-npu_swiglu).
        if x.dtype not in _FLOATS or x.numel() == 0 or x.shape[-1] % 2:
            return super().silu_and_mul(x)
        return torch_npu.npu_swiglu(x.contiguous(), dim=-1)

    def moe_gating_topk(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # npu_moe_gating_top_k_softmax(x, finished=None, k=1) -> (y, expert_idx int32,
        # row_idx): softmax then top-k; 2-D/3-D x, k <= 1024; y has x's dtype, so x is fed
        # as float32 to keep base.py's float32 softmax (hiascend ptaoplist_000856).
        num_experts = router_logits.shape[-1]
        if router_logits.dim() != 2 or not 0 < top_k <= min(num_experts, _TOPK_MAX):
            return super().moe_gating_topk(router_logits, top_k, renormalize)
        weights, ids, _ = torch_npu.npu_moe_gating_top_k_softmax(
            router_logits.float(), finished=None, k=top_k
        )
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids.long()

    @staticmethod
    def _gmm_ok(dtype: torch.dtype, weight: torch.Tensor) -> bool:
        """npu_grouped_matmul, single x / weight / y tensors, m-axis groups (op-plugin doc).

        Non-quantized fp16/bf16/fp32 with x and weight of one dtype; at most 1024 groups;
        the inner (K) axis below 65536.
        """
        return (dtype in _FLOATS and weight.dtype == dtype and weight.dim() == 3
                and weight.shape[0] <= _MAX_GROUPS and weight.shape[-1] < _INNER_LIMIT)

    @staticmethod
    def _gmm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, K] sorted by group, weight [E, M, K], counts [E] int64 -> [N, M]."""
        # group_type=0 groups the m axis; group_list_type=1 means per-group sizes (0 would
        # be a cumsum); split_item=2 returns one tensor. The op wants weight [E, K, M]: the
        # transposed view of the nn.Linear layout is accepted as-is ("支持weight转置"), as
        # vllm-ascend ops/fused_moe/moe_mlp.py unquant_apply_mlp(need_trans=True) passes it.
        return torch_npu.npu_grouped_matmul(
            [x.contiguous()], [weight.transpose(1, 2)],
            group_list=counts, split_item=2, group_type=0, group_list_type=1,
        )[0]

    def grouped_matmul(
        self, x: torch.Tensor, weight: torch.Tensor, group_sizes: list[int]
    ) -> torch.Tensor:
        if x.shape[0] == 0 or not self._gmm_ok(x.dtype, weight):
            return super().grouped_matmul(x, weight, group_sizes)
        counts = torch.tensor(group_sizes, dtype=torch.int64, device=x.device)  # [E]
        return self._gmm(x, weight, counts)

    def fused_moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        # base.fused_moe's math, but the group sizes stay on the device (no .tolist() sync).
        if (x.shape[0] == 0 or not self._gmm_ok(x.dtype, w13)
                or not self._gmm_ok(x.dtype, w2)):
            return super().fused_moe(x, w13, w2, topk_weights, topk_ids)
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # [T*k]
        token_of = order // top_k  # source token of each sorted row
        counts = torch.bincount(flat_ids, minlength=w13.shape[0])  # [E] int64
        xs = x.index_select(0, token_of)  # [T*k, H]
        h = self.silu_and_mul(self._gmm(xs, w13, counts))  # [T*k, I]
        ys = self._gmm(h, w2, counts)  # [T*k, H]
        ys = ys * topk_weights.reshape(-1)[order].unsqueeze(1).to(ys.dtype)
        out = torch.zeros_like(x)
        out.index_add_(0, token_of, ys)
        return out

    # -- sampling ---------------------------------------------------------------------
    def top_k_top_p(
        self, logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
    ) -> torch.Tensor:
        # npu_top_k_top_p(logits, p, k): the same ascending-sort threshold top-k and
        # cumsum <= 1 - p top-p as base.py (formula in op-plugin doc
        # torch_npu-npu_top_k_top_p.md). Both p and k are required: p [B] in logits' dtype,
        # k [B] int32 in [1, 1024] and <= vocab. Argument order is (logits, p, k).
        if top_k is None and top_p is None:
            return logits
        batch, vocab = logits.shape
        if not _HAS_TOP_K_TOP_P or logits.dtype not in _FLOATS:
            return super().top_k_top_p(logits, top_k, top_p)
        if top_k is None:
            if vocab > _TOPK_MAX:  # "off" (k = vocab) is not expressible
                return super().top_k_top_p(logits, top_k, top_p)
            k = torch.full((batch,), vocab, dtype=torch.int32, device=logits.device)
        else:
            k64 = top_k.clamp(1, vocab)  # base: k >= vocab is off, k < 1 behaves as 1
            if int(k64.max()) > _TOPK_MAX:  # one host sync on [B]
                return super().top_k_top_p(logits, top_k, top_p)
            k = k64.to(torch.int32)
        if top_p is None:
            p = torch.ones(batch, dtype=logits.dtype, device=logits.device)  # 1.0 = off
        else:
            p = top_p.to(logits.dtype)
        return torch_npu.npu_top_k_top_p(logits, p, k)
