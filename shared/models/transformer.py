"""The pre-norm decoder that Llama, Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V3 share.

Plain classes holding tensors (no nn.Module hooks on the hot path); every op goes
through the kernel backend. Projection weights are stored input-major ([in, out], so a
projection is one ``x @ w``, faster than ``F.linear`` for small batches) and fused at
load: q|k|v into one matrix, gate|up into one, experts stacked into [E, H, 2I] and
[E, I, H].

    tokens -> embed -> [ norm -> attention -> +res -> norm -> mlp/moe -> +res ] x L
           -> norm (only the rows that need logits) -> lm_head -> float32 logits

DeepSeek-V3's attention is MLA (``MLAWeights``): each token's K and V are one latent
(kv_lora_rank dims, normed, plus qk_rope_head_dim of shared rotary key), and that latent
is all the paged cache holds. Attention runs in the absorbed form, prefill and decode
alike: W_UK folded into the query, every head attends over the one latent "head" (the
paged attention kernels, as MQA with head_dim kv_lora_rank + rope), W_UV applied after:

    q [T, H, nope | rope] ─ q_nope @ W_UK[h] ─▶ [T, H, L | rope] ─┐
    x ─ kv_a ─▶ [c (normed, L) | k_rope (rotated, R)] ─ cache ────┴▶ attention
        ─▶ [T, H, L (| rope, dropped)] ─ @ W_UV[h] ─▶ [T, H, v] ─ o ─▶ [T, hidden]

Its MoE layers (DeepSeekMoE) route with sigmoid scores and grouped top-k
(``moe_gating_grouped_topk``) and add shared experts every token goes through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pdmesh.shared.kernels import AttentionMetadata, KernelBackend
from pdmesh.shared.models.config import ModelConfig
from pdmesh.shared.models.rotary import rotary_tables

KVCache = dict[str, torch.Tensor]  # one layer's cache tensors by role: k and v, or latent


@dataclass
class AttentionWeights:
    qkv: torch.Tensor  # [hidden, (H + 2*KVH) * D]
    qkv_bias: torch.Tensor | None  # [(H + 2*KVH) * D]
    o: torch.Tensor  # [H * D, hidden]
    qk_norm: torch.Tensor | None  # [H + KVH, D]: q_norm per query head, then k_norm


@dataclass
class MLAWeights:
    q: torch.Tensor | None  # [hidden, H * (nope + rope)]  (no q-LoRA)
    q_a: torch.Tensor | None  # [hidden, q_lora]  (q-LoRA)
    q_a_norm: torch.Tensor | None  # [q_lora]
    q_b: torch.Tensor | None  # [q_lora, H * (nope + rope)]
    kv_a: torch.Tensor  # [hidden, L + R]: the latent and the shared rotary key
    kv_a_norm: torch.Tensor  # [L]
    w_uk: torch.Tensor  # [H, nope, L]: k_nope of head h is W_UK[h] @ c, absorbed into q
    w_uv: torch.Tensor  # [H, L, v]: head h's value is c @ W_UV[h], applied after attention
    o: torch.Tensor  # [H * v, hidden]


@dataclass
class DenseMLPWeights:
    gate_up: torch.Tensor  # [hidden, 2I]
    down: torch.Tensor  # [I, hidden]


@dataclass
class MoEWeights:
    router: torch.Tensor  # [hidden, E]
    w13: torch.Tensor  # [E, hidden, 2I]  (gate | up)
    w2: torch.Tensor  # [E, I, hidden]
    correction_bias: torch.Tensor | None = None  # [E] float32 (DeepSeek's noaux_tc)
    shared: DenseMLPWeights | None = None  # shared experts, as one dense MLP
    tid2eid: torch.Tensor | None = None  # [V, k] DeepSeek-V4 hash layers: experts by token


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    post_attn_norm: torch.Tensor  # [hidden]
    attn: AttentionWeights | MLAWeights
    mlp: DenseMLPWeights | MoEWeights


@dataclass
class MtpWeights:
    """One multi-token-prediction layer (DeepSeek's ``num_nextn_predict_layers``): from
    the target's hidden state at position i and the embedding of token i + 1 it predicts
    token i + 2 through one decoder layer of its own:

        head(norm(layer(eh_proj(cat(enorm(embed(t_(i+1))), hnorm(h_i))))))
    """

    enorm: torch.Tensor  # [hidden]
    hnorm: torch.Tensor  # [hidden]
    eh_proj: torch.Tensor  # [2 * hidden, hidden]
    layer: LayerWeights
    head_norm: torch.Tensor  # [hidden]
    head: torch.Tensor  # [hidden, V]
    embed: torch.Tensor  # [V, hidden]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [hidden, V]  (a transposed view of the embedding when tied)
    # multi-token-prediction layers (DeepSeek's num_nextn_predict_layers): run only by
    # the MTP proposer (``CausalLM.mtp_forward``), never as decoder layers
    mtp: list[MtpWeights] = field(default_factory=list)


def weight_tensors(obj: Any, skip: frozenset[str] = frozenset()) -> list[torch.Tensor]:
    """Every tensor a model's weights hold, once each (walked through their dataclasses,
    lists and dicts; fields named in ``skip`` left out)."""
    seen: dict[int, torch.Tensor] = {}

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            seen.setdefault(id(o), o)
        elif isinstance(o, (list, tuple)):
            for item in o:
                walk(item)
        elif isinstance(o, dict):
            for item in o.values():
                walk(item)
        elif hasattr(o, "__dataclass_fields__"):
            for name in o.__dataclass_fields__:
                if name not in skip:
                    walk(getattr(o, name))

    walk(obj)
    return list(seen.values())


def weight_bytes(obj: Any) -> int:
    """What the weights take in memory: each storage once (a tied LM head, a view of the
    embedding, adds nothing)."""
    storages: dict[int, int] = {}
    for t in weight_tensors(obj):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class MoESteps:
    """What both model classes' MoE layers do beside their experts, each a method of
    its own so a decode graph can run it between its pieces (shared/engine/
    decode_graphs.py): expert parallelism's exchange (its sizes are read on the host;
    its collectives pair with the other DP ranks' steps) and the expert-load record
    (the step's real rows alone); and a projection with the rows' LoRA updates. Needs
    ``ep``, ``load_recorder``, ``_moe_index``, ``backend``, ``lora`` and
    ``_lora_layer``."""

    graph_holes = {"_ep_moe": ("x", "weights", "ids"), "_record_load": ("ids",)}

    def _ep_moe(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        """The routed experts over the expert-parallel ranks."""
        assert self.ep is not None
        return self.ep.moe(layer, x, weights, ids, self.backend)

    def _record_load(self, layer: int, ids: torch.Tensor) -> None:
        """MoE layer ``layer``'s routing in this step, for EPLB."""
        assert self.load_recorder is not None
        self.load_recorder.record(self._moe_index[layer], ids)

    def _lora_linear(self, x: torch.Tensor, w, site: str,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
        """A projection of the decoder layer being run (``_lora_layer``; None: an MTP
        layer's, which has no adapters), with the rows' LoRA updates of ``site`` when the
        forward runs adapters (``lora``: shared.engine.lora.LoraStep)."""
        out = self.backend.linear(x, w, bias)
        if self.lora is not None and self._lora_layer is not None:
            self.lora.apply(self._lora_layer, site, x, out)
        return out


class CausalLM(MoESteps):
    """forward(tokens of a flat varlen batch) -> logits for the rows asked for."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, backend: KernelBackend):
        self.config = config
        self.w = weights
        self.backend = backend
        self.scale = config.mla.softmax_scale if config.mla else config.head_dim**-0.5
        self.q_size = config.num_heads * config.head_dim
        # what the attention hands its output projection, per token (every head of this
        # rank; a fine-grained o_proj holds a slice of its rows)
        self._o_width = (config.num_heads * config.mla.v_head_dim if config.mla
                         else self.q_size)
        self.kv_size = config.num_kv_heads * config.head_dim
        # MoE layers, in order; set by the engine: expert parallelism across DP ranks and
        # the expert-load recorder (None: single process, nothing recorded)
        self.moe_layers = [i for i, lw in enumerate(weights.layers)
                           if isinstance(lw.mlp, MoEWeights)]
        self._moe_index = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.ep = None
        self.load_recorder = None
        # tensor parallelism: this rank's collectives (None: the whole model here);
        # fine-grained TP: the modules split over DP ranks (None: none is)
        self.tp = None
        self.fg = None
        self.shared_expert_dp = False  # TP + EP: shared experts whole, on a token share
        # LoRA adapters of the current forward (shared.engine.lora.LoraStep; None: the
        # base model alone) and the decoder layer being run (an MTP layer's: None)
        self.lora = None
        self._lora_layer: int | None = None
        cos, sin = rotary_tables(config.rotary_dim, config.max_position_embeddings,
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
        hidden_out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [B, V] float32
        """``hidden_out``: gets the final (normed) hidden state of every row, [T, hidden],
        what an MTP layer continues from."""
        be = self.backend
        eps = self.config.rms_norm_eps
        cos = self.cos.index_select(0, positions)  # [T, D]
        sin = self.sin.index_select(0, positions)
        tp, fg = self.tp, self.fg
        if fg is not None:  # the group's row counts, for the split modules' padding
            fg.begin(input_ids.shape[0], logits_rows.shape[0], input_ids.device)
        if fg is not None and fg.layout.shard("embedding") is not None:
            h = fg.embed(self.w.embed, input_ids)
        elif tp is not None:
            h = tp.embed(self.w.embed, input_ids)
        else:
            h = self.w.embed.index_select(0, input_ids)  # [T, hidden]
        residual: torch.Tensor | None = None
        for i, (layer, kv) in enumerate(zip(self.w.layers, kv_caches, strict=True)):
            self._lora_layer = i
            if residual is None:
                residual = h
                x = be.rms_norm(h, layer.input_norm, eps)
            else:
                x, residual = be.add_rms_norm(h, residual, layer.input_norm, eps)
            if x.shape[0]:
                h = self._attention(layer.attn, x, cos, sin, kv, meta)
            else:  # a lockstep rank's idle forward: its collectives, nothing to attend
                h = self._o_proj(layer.attn, x.new_zeros((0, self._o_width)))
            if tp is not None:  # the heads' partial outputs summed
                tp.all_reduce(h)
            x, residual = be.add_rms_norm(h, residual, layer.post_attn_norm, eps)
            h = self._mlp(layer.mlp, x, i)
            if tp is not None:
                tp.all_reduce(h)
        assert residual is not None
        self._lora_layer = None
        if hidden_out is not None:
            every = be.rms_norm(h + residual, self.w.final_norm, eps)
            hidden_out.append(every)
            return self._logits(every.index_select(0, logits_rows))
        last = (h + residual).index_select(0, logits_rows)  # [B, hidden]
        return self._logits(be.rms_norm(last, self.w.final_norm, eps))

    @staticmethod
    def final_hidden(hidden: torch.Tensor) -> torch.Tensor:
        """Rows of ``hidden_out`` -> the final normed hidden states (they are already)."""
        return hidden

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        if self.fg is not None and self.fg.layout.shard("lmhead") is not None:
            return self.fg.lm_head(last, self.w.lm_head, self.backend)
        logits = self.backend.linear(last, self.w.lm_head).float()
        return logits if self.tp is None else self.tp.gather_logits(logits)

    def _o_proj(self, w: AttentionWeights | MLAWeights, o: torch.Tensor) -> torch.Tensor:
        """The attention's output projection, o [T, heads x head dim] -> [T, hidden]."""
        if self.fg is not None and self.fg.layout.shard("oproj") is not None:
            return self.fg.o_proj(o, w.o, self.backend)
        return self._lora_linear(o, w.o, "o")

    @torch.inference_mode()
    def mtp_forward(
        self,
        index: int,  # which MTP layer
        input_ids: torch.Tensor,  # [T]: token i + 1 for each row at position i
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, hidden]: the target's (or the previous MTP step's)
        kv: KVCache,  # the MTP layer's own cache
        meta: AttentionMetadata,
        logits_rows: torch.Tensor,  # [B]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [B, V] float32, hidden [T, hidden]
        """One MTP layer over a flat varlen batch, as vLLM's DeepSeek MTP runs it (the
        embedding at position 0 masked out). Returns the draft logits of ``logits_rows``
        and every row's output hidden state, which a chained step continues from."""
        m = self.w.mtp[index]
        out = self.mtp_block(m, self.mtp_input(m, input_ids, positions, hidden), positions,
                             kv, meta)
        return self.mtp_logits(m, out.index_select(0, logits_rows)), out

    def mtp_input(self, m: MtpWeights, input_ids: torch.Tensor, positions: torch.Tensor,
                  hidden: torch.Tensor) -> torch.Tensor:
        """eh_proj(cat(enorm(embed(token)), hnorm(hidden))), the embedding zeroed at
        position 0 (differentiable: ``pdmesh make-tiny-model --train-mtp`` trains it)."""
        be, eps = self.backend, self.config.rms_norm_eps
        e = (m.embed.index_select(0, input_ids) if self.tp is None
             else self.tp.embed(m.embed, input_ids))
        e = be.rms_norm(e, m.enorm, eps)
        e = e.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        return be.linear(torch.cat((e, be.rms_norm(hidden, m.hnorm, eps)), dim=-1), m.eh_proj)

    def mtp_block(self, m: MtpWeights, x: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                  meta: AttentionMetadata) -> torch.Tensor:
        """The MTP layer's decoder layer; returns its output hidden state (residual
        added)."""
        be, eps = self.backend, self.config.rms_norm_eps
        cos = self.cos.index_select(0, positions)
        sin = self.sin.index_select(0, positions)
        layer = m.layer
        h = self._attention(layer.attn, be.rms_norm(x, layer.input_norm, eps), cos, sin, kv,
                            meta)
        if self.tp is not None:
            self.tp.all_reduce(h)
        y, residual = be.add_rms_norm(h, x, layer.post_attn_norm, eps)
        out = self._mlp(layer.mlp, y, None)
        if self.tp is not None:
            self.tp.all_reduce(out)
        return out + residual

    def mtp_logits(self, m: MtpWeights, out: torch.Tensor) -> torch.Tensor:
        """shared_head: head(norm(out)), float32."""
        be = self.backend
        logits = be.linear(be.rms_norm(out, m.head_norm, self.config.rms_norm_eps),
                           m.head).float()
        return logits if self.tp is None else self.tp.gather_logits(logits)

    def _attention(
        self,
        w: AttentionWeights | MLAWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if isinstance(w, MLAWeights):
            return self._latent_attention(w, x, cos, sin, kv, meta)
        be, cfg = self.backend, self.config
        t = x.shape[0]
        qkv = self._lora_linear(x, w.qkv, "qkv", w.qkv_bias)  # [T, (H + 2*KVH) * D]
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, cfg.head_dim)  # [T, H+KVH, D]
        v = qkv[:, self.q_size + self.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
        if w.qk_norm is not None:
            qk = be.head_rms_norm(qk, w.qk_norm, cfg.rms_norm_eps)
        qk = be.rotary_embedding(qk, cos, sin)
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        k_cache, v_cache = kv["k"], kv["v"]
        if "k_scale" in kv:  # --kv-cache-dtype int8
            scales = kv["k_scale"], kv["v_scale"]
            be.write_int8_cache(k, k_cache, scales[0], meta.slot_mapping)
            be.write_int8_cache(v, v_cache, scales[1], meta.slot_mapping)
            if meta.is_decode:
                o = be.paged_attention_decode_int8(q, (k_cache, v_cache), scales, meta,
                                                   self.scale)
            else:
                o = be.paged_attention_prefill_int8(q, k, v, (k_cache, v_cache), scales, meta,
                                                    self.scale)
            return self._o_proj(w, o.reshape(t, self.q_size))
        be.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode:
            o = be.paged_attention_decode(q, k_cache, v_cache, meta, self.scale)
        else:
            o = be.paged_attention_prefill(q, k, v, k_cache, v_cache, meta, self.scale)
        return self._o_proj(w, o.reshape(t, self.q_size))  # [T, hidden]

    def _latent_attention(
        self,
        w: MLAWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVCache,  # latent [blocks, bs, 1, L + R] (and its int8 scales)
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        be, cfg = self.backend, self.config
        m = cfg.mla
        assert m is not None
        t, h = x.shape[0], cfg.num_heads
        nope, lat = m.qk_nope_head_dim, m.kv_lora_rank
        if w.q is not None:
            q = self._lora_linear(x, w.q, "q")
        else:
            q_a = be.rms_norm(self._lora_linear(x, w.q_a, "q_a"), w.q_a_norm, cfg.rms_norm_eps)
            q = self._lora_linear(q_a, w.q_b, "q_b")
        q = q.view(t, h, nope + m.qk_rope_head_dim)
        latent = self._lora_linear(x, w.kv_a, "kv_a")  # [T, L + R]
        c = be.rms_norm(latent[:, :lat], w.kv_a_norm, cfg.rms_norm_eps)  # [T, L]
        # one rotary call for the query heads' rope dims and the shared key's
        rope = be.rotary_embedding(torch.cat((q[:, :, nope:], latent[:, None, lat:]), dim=1),
                                   cos, sin)  # [T, H + 1, R]
        entry = torch.cat((c, rope[:, h]), dim=-1).unsqueeze(1)  # [T, 1, L + R]
        cache, cache_scale = kv["latent"], kv.get("latent_scale")
        if cache_scale is not None:  # --kv-cache-dtype int8
            be.write_int8_cache(entry, cache, cache_scale, meta.slot_mapping)
        else:
            be.write_cache(entry, cache, meta.slot_mapping)
        q_latent = torch.bmm(q[:, :, :nope].transpose(0, 1), w.w_uk).transpose(0, 1)
        query = torch.cat((q_latent, rope[:, :h]), dim=-1)  # [T, H, L + R]
        # the values are the latents: their rope dims are not part of them
        if meta.is_decode and cache_scale is not None:
            o = be.latent_attention_decode_int8(query, cache, cache_scale, meta, self.scale,
                                                lat)
        elif meta.is_decode:
            o = be.latent_attention_decode(query, cache, meta, self.scale, lat)
        elif cache_scale is not None:
            o = be.latent_attention_prefill_int8(query, entry, cache, cache_scale, meta,
                                                 self.scale, lat)
        else:
            o = be.latent_attention_prefill(query, entry, cache, meta, self.scale, lat)
        v = torch.bmm(o.transpose(0, 1), w.w_uv).transpose(0, 1)  # [T, H, v]
        return self._o_proj(w, v.reshape(t, h * m.v_head_dim))  # [T, hidden]

    def _mlp(self, w: DenseMLPWeights | MoEWeights, x: torch.Tensor, layer: int | None
             ) -> torch.Tensor:
        """``layer`` None: an MTP layer's, whose experts every rank holds whole."""
        be = self.backend
        if isinstance(w, DenseMLPWeights):
            fg = self.fg
            if (fg is not None and layer is not None and fg.layout.shard("mlp") is not None
                    and w is self.w.layers[layer].mlp):  # (a dense layer's, not shared experts)
                return fg.mlp(x, w.gate_up, w.down, be)
            shared = layer is not None and w is not self.w.layers[layer].mlp
            up, down = ("shared_gate_up", "shared_down") if shared else ("gate_up", "down")
            return self._lora_linear(be.silu_and_mul(self._lora_linear(x, w.gate_up, up)),
                                     w.down, down)
        weights, ids = self._route(w, x)
        if self.load_recorder is not None and layer is not None:
            self._record_load(layer, ids)
        tp, ep = self.tp, self.ep if layer is not None else None
        if tp is not None and (ep is not None or not tp.shard.experts):
            # experts whole here (EP's slots, or an MTP layer's under EP): every TP rank
            # holds the step's tokens and sends its share through them
            def experts(rows: torch.Tensor, ws: torch.Tensor, ids_: torch.Tensor
                        ) -> torch.Tensor:
                if ep is not None:
                    return self._ep_moe(layer, rows, ws, ids_)
                return be.fused_moe(rows, w.w13, w.w2, ws.to(x.dtype), ids_)

            whole = w.shared is not None and self.shared_expert_dp
            out = tp.moe_on_share(x, weights, ids, experts, (
                lambda rows: self._mlp(w.shared, rows, layer)) if whole else None)
            if whole:
                return out
        elif ep is not None:
            out = self._ep_moe(layer, x, weights, ids)
        else:
            out = be.fused_moe(x, w.w13, w.w2, weights.to(x.dtype), ids)
        if w.shared is not None:
            out = out + self._mlp(w.shared, x, layer)
        return out

    def _route(self, w: MoEWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) for each token."""
        moe = self.config.moe
        assert moe is not None
        if moe.scoring == "softmax":
            return self.backend.moe_gating_topk(torch.mm(x, w.router), moe.top_k,
                                                moe.norm_topk_prob)
        router_logits = torch.mm(x.float(), w.router.float())  # [T, E], in float32
        return self.backend.moe_gating_grouped_topk(
            router_logits, moe.top_k, moe.num_groups, moe.topk_groups, w.correction_bias,
            moe.norm_topk_prob, moe.routed_scaling)

