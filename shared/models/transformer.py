"""The pre-norm decoder that Llama, Qwen2, Qwen3 and Qwen3-MoE share.

Plain classes holding tensors (no nn.Module hooks on the hot path); every op goes
through the kernel backend. Projection weights are stored input-major ([in, out], so a
projection is one ``x @ w``, faster than ``F.linear`` for small batches) and fused at
load: q|k|v into one matrix, gate|up into one, experts stacked into [E, H, 2I] and
[E, I, H].

    tokens -> embed -> [ norm -> attention -> +res -> norm -> mlp/moe -> +res ] x L
           -> norm (only the rows that need logits) -> lm_head -> float32 logits
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdmesh.shared.kernels import AttentionMetadata, KernelBackend
from pdmesh.shared.models.config import ModelConfig
from pdmesh.shared.models.rotary import rotary_tables

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), one layer


@dataclass
class AttentionWeights:
    qkv: torch.Tensor  # [hidden, (H + 2*KVH) * D]
    qkv_bias: torch.Tensor | None  # [(H + 2*KVH) * D]
    o: torch.Tensor  # [H * D, hidden]
    qk_norm: torch.Tensor | None  # [H + KVH, D]: q_norm per query head, then k_norm


@dataclass
class DenseMLPWeights:
    gate_up: torch.Tensor  # [hidden, 2I]
    down: torch.Tensor  # [I, hidden]


@dataclass
class MoEWeights:
    router: torch.Tensor  # [hidden, E]
    w13: torch.Tensor  # [E, hidden, 2I]  (gate | up)
    w2: torch.Tensor  # [E, I, hidden]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    post_attn_norm: torch.Tensor  # [hidden]
    attn: AttentionWeights
    mlp: DenseMLPWeights | MoEWeights


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [hidden, V]  (a transposed view of the embedding when tied)


class CausalLM:
    """forward(tokens of a flat varlen batch) -> logits for the rows asked for."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, backend: KernelBackend):
        self.config = config
        self.w = weights
        self.backend = backend
        self.scale = config.head_dim**-0.5
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        # MoE layers, in order; set by the engine: expert parallelism across DP ranks and
        # the expert-load recorder (None: single process, nothing recorded)
        self.moe_layers = [i for i, lw in enumerate(weights.layers)
                           if isinstance(lw.mlp, MoEWeights)]
        self._moe_index = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.ep = None
        self.load_recorder = None
        cos, sin = rotary_tables(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        # [max_pos, D] float32, in the form the backend's rotary kernel takes
        self.cos, self.sin = backend.rotary_tables(cos.to(backend.device), sin.to(backend.device))

    @property
    def dtype(self) -> torch.dtype:
        return self.w.embed.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        logits_rows: torch.Tensor,  # [B] int64: rows whose next-token logits are needed
    ) -> torch.Tensor:  # [B, V] float32
        be = self.backend
        eps = self.config.rms_norm_eps
        cos = self.cos.index_select(0, positions)  # [T, D]
        sin = self.sin.index_select(0, positions)
        h = self.w.embed.index_select(0, input_ids)  # [T, hidden]
        residual: torch.Tensor | None = None
        for i, (layer, kv) in enumerate(zip(self.w.layers, kv_caches, strict=True)):
            if residual is None:
                residual = h
                x = be.rms_norm(h, layer.input_norm, eps)
            else:
                x, residual = be.add_rms_norm(h, residual, layer.input_norm, eps)
            h = self._attention(layer.attn, x, cos, sin, kv, meta)
            x, residual = be.add_rms_norm(h, residual, layer.post_attn_norm, eps)
            h = self._mlp(layer.mlp, x, i)
        assert residual is not None
        last = (h + residual).index_select(0, logits_rows)  # [B, hidden]
        last = be.rms_norm(last, self.w.final_norm, eps)
        return torch.mm(last, self.w.lm_head).float()

    def _attention(
        self,
        w: AttentionWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        be, cfg = self.backend, self.config
        t = x.shape[0]
        qkv = _project(x, w.qkv, w.qkv_bias)  # [T, (H + 2*KVH) * D]
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, cfg.head_dim)  # [T, H+KVH, D]
        v = qkv[:, self.q_size + self.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
        if w.qk_norm is not None:
            qk = be.head_rms_norm(qk, w.qk_norm, cfg.rms_norm_eps)
        qk = be.rotary_embedding(qk, cos, sin)
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        k_cache, v_cache = kv
        be.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode:
            o = be.paged_attention_decode(q, k_cache, v_cache, meta, self.scale)
        else:
            o = be.paged_attention_prefill(q, k, v, k_cache, v_cache, meta, self.scale)
        return torch.mm(o.reshape(t, self.q_size), w.o)  # [T, hidden]

    def _mlp(self, w: DenseMLPWeights | MoEWeights, x: torch.Tensor, layer: int
             ) -> torch.Tensor:
        be = self.backend
        if isinstance(w, DenseMLPWeights):
            return torch.mm(be.silu_and_mul(torch.mm(x, w.gate_up)), w.down)
        moe = self.config.moe
        assert moe is not None
        router_logits = torch.mm(x, w.router)  # [T, E]
        weights, ids = be.moe_gating_topk(router_logits, moe.top_k, moe.norm_topk_prob)
        if self.load_recorder is not None:
            self.load_recorder.record(self._moe_index[layer], ids)
        if self.ep is not None:
            return self.ep.moe(layer, x, weights, ids, be)
        return be.fused_moe(x, w.w13, w.w2, weights.to(x.dtype), ids)


def _project(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)
