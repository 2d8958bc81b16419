"""DeepSeek-V4: sliding-window attention with compressed long-range entries, hyper-
connections and hash-routed MoE, over the paged cache groups of
:mod:`pdmesh.shared.engine.kv_cache_spec`.

    tokens -> embed -> n streams ─┬─ hc_pre ─ norm ─ attention ─ hc_post ─┐
                                  │  (collapse the streams; mix them back)│ x L
                                  └─ hc_pre ─ norm ─ MoE ─────── hc_post ─┘
           -> hc_head (collapse) -> norm -> lm_head

Attention has one K=V head per token (normed, its last ``rope_dim`` dims rotated) and
many query heads; each query sees

    the window      its own and the previous window - 1 tokens' K=V (every layer)
    the entries     a compressed layer's entries of rate m, each summarizing m tokens
                    (a softmax-gated sum of per-token projections, normed and rotated
                    at the window's first position), only those whose window is over:
                    HCA all of them, CSA the ``index_topk`` a lightning indexer scores
                    highest (the CSA windows overlap: entry w draws on windows w-1, w)

with a learned sink per head in the softmax; the rotation is undone on the output
(K = V carried it), and a grouped low-rank projection brings the heads back.

The cache keeps, per request: the window K=V and the compressors' per-token inputs
(``window`` group, sliding: only the last ``state_window`` tokens), and the entries and
indexer keys (``compressed`` group, every block). Everything is written per token or
per entry, so any chunking, a prefix-cache hit, a pool transfer or a recompute of the
last token continue exactly. Rotary dims, interleaved in the checkpoint, are put in
rotate-half order at load (q, K=V, the compressors, the indexer and the output
projection's input alike), so the rotary kernel is the one every model uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdmesh.shared.kernels import AttentionMetadata, KernelBackend
from pdmesh.shared.kernels.base import score_experts
from pdmesh.shared.models.config import SLIDING, ModelConfig
from pdmesh.shared.models.rotary import rotary_tables
from pdmesh.shared.models.transformer import DenseMLPWeights, KVCache, MoESteps, MoEWeights
from pdmesh.shared.models.v4_step import Compression, Step, step_plan


@dataclass
class CompressorWeights:
    rate: int
    overlap: bool  # CSA: each entry spans its window and the previous one
    dim: int  # the entry's size (head_dim, or the indexer's head size)
    ape: torch.Tensor  # [rate, (1 + overlap) * dim] float32: the gate's position bias
    norm: torch.Tensor  # [dim]

    @property
    def width(self) -> int:
        """Per token: kv and gate, (1 + overlap) * dim each."""
        return 2 * (1 + self.overlap) * self.dim


@dataclass
class V4AttentionWeights:
    # everything computed from the attention's input, in one matmul, split as
    # q_lora | kv | compressor (kv | gate) | indexer compressor (kv | gate) | index weights
    x_proj: torch.Tensor  # [hidden, sum(splits)]
    splits: tuple[int, ...]
    q_a_norm: torch.Tensor  # [q_lora]
    q_b: torch.Tensor  # [q_lora, H * D]
    kv_norm: torch.Tensor  # [D]
    o_a: torch.Tensor  # [groups, H * D / groups, o_lora]
    o_b: torch.Tensor  # [groups * o_lora, hidden] (fine-grained TP: its input rows)
    sinks: torch.Tensor  # [H] float32
    compressor: CompressorWeights | None = None
    index_q: torch.Tensor | None = None  # [q_lora, index_heads * index_head_dim]
    index_compressor: CompressorWeights | None = None

    @property
    def o_b_width(self) -> int:
        """wo_b's whole input width, groups * o_lora (what o_a gives)."""
        return self.o_a.shape[0] * self.o_a.shape[2]


@dataclass
class HyperConnectionWeights:
    fn: torch.Tensor  # [hc * hidden, mixes] float32, input-major
    base: torch.Tensor  # [mixes] float32
    scale: torch.Tensor  # [3] (a layer's pre / post / comb) or [1] (the head) float32


@dataclass
class V4LayerWeights:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    attn_hc: HyperConnectionWeights
    ffn_hc: HyperConnectionWeights
    attn: V4AttentionWeights
    mlp: MoEWeights  # tid2eid set on hash layers


@dataclass
class V4MtpWeights:
    """One multi-token-prediction block (DeepSeek's ``mtp.{i}``): from the target's
    streams at position i (before its head collapses them) and token i + 1 it predicts
    token i + 2 through a V4 layer of its own (sliding-window attention, learned-router
    MoE, hyper-connections), collapsed by its own head mix and norm into the model's head:

        streams = e_proj(enorm(embed(t_(i+1)))) + h_proj(hnorm(streams_i))   (per stream)
        logits  = head(norm(hc_head(layer(streams))))

    The embedding is zeroed at position 0, as vLLM-Ascend's DeepSeek-V4 MTP does; the
    embedding and head are the model's unless the checkpoint gives the block its own
    (``mtp.{i}.emb.tok_emb.weight``, ``mtp.{i}.head.weight``).
    """

    e_proj: torch.Tensor  # [hidden, hidden]
    h_proj: torch.Tensor  # [hidden, hidden]
    enorm: torch.Tensor
    hnorm: torch.Tensor
    norm: torch.Tensor
    hc_head: HyperConnectionWeights
    layer: V4LayerWeights
    embed: torch.Tensor  # [V, hidden]
    head: torch.Tensor  # [hidden, V]


@dataclass
class V4Weights:
    embed: torch.Tensor  # [V, hidden]
    layers: list[V4LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [hidden, V]
    hc_head: HyperConnectionWeights
    mtp: list[V4MtpWeights] = field(default_factory=list)
    # MTP blocks the checkpoint has but pdmesh does not run (compressed attention)
    mtp_not_run: str | None = None


class DeepseekV4(MoESteps):
    """forward(tokens of a flat varlen batch) -> logits for the rows asked for; the same
    interface as :class:`~pdmesh.shared.models.transformer.CausalLM`."""

    def __init__(self, config: ModelConfig, weights: V4Weights, backend: KernelBackend):
        assert config.v4 is not None and config.moe is not None
        self.config = config
        self.v4 = config.v4
        self.w = weights
        self.backend = backend
        self.scale = self.v4.head_dim ** -0.5
        self.moe_layers = list(range(config.num_layers))  # every V4 layer routes
        self._moe_index = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.ep = None
        self.load_recorder = None
        # tensor parallelism (its collectives; None: the whole model here); the modules
        # fine-grained TP splits (the embedding, the lm_head, the grouped output
        # projection's second half, wo_b, by its input) and TP + EP's shared-expert DP
        self.tp = None
        self.fg = None
        self.shared_expert_dp = False
        dev, v4 = backend.device, self.v4
        # the sliding layers' rope is plain; the compressed layers', their compressors'
        # and indexers' is its own theta, with yarn
        self.rope = {
            "main": backend.rotary_tables(*(t.to(dev) for t in rotary_tables(
                v4.rope_dim, config.max_position_embeddings, config.rope_theta, None))),
            "compress": backend.rotary_tables(*(t.to(dev) for t in rotary_tables(
                v4.rope_dim, config.max_position_embeddings, v4.compress_rope_theta,
                v4.compress_rope_scaling))),
        }
        self.limit = v4.swiglu_limit or None
        self._ones = torch.ones(1, v4.head_dim, dtype=weights.embed.dtype, device=dev)
        # LoRA adapters of the current forward (shared.engine.lora.LoraStep; None: the
        # base model alone) and the layer running (None: an MTP block's, which has none;
        # sites: pdmesh.shared.models.lora_v4)
        self.lora = None
        self._lora_layer: int | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.w.embed.dtype

    # Decode graphs (shared/engine/decode_graphs.py): the step plan is built on the host
    # before the first piece (``graph_state``), and attention, which reads it, runs
    # between the pieces on the step's rows (x, and the rope tables of its positions).
    graph_holes = {"_attention": ("x", "rope"), **MoESteps.graph_holes}

    def graph_state(self, meta: AttentionMetadata, positions: torch.Tensor) -> Step:
        return self._step(meta, positions)

    # -- the step plan ----------------------------------------------------------------
    def _step(self, meta: AttentionMetadata, positions: torch.Tensor,
              compressed: bool = True) -> Step:
        """``compressed`` False: the window alone (an MTP block's sliding layer), no
        compression plans."""
        return step_plan(self.v4, meta, positions, self.backend.device, compressed)

    # -- the forward ------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        logits_rows: torch.Tensor,  # [B] int64
        hidden_out: list[torch.Tensor] | None = None,
        step: Step | None = None,
    ) -> torch.Tensor:  # [B, V] float32
        """``hidden_out``: gets every row's streams before the head collapses them,
        [T, hc * hidden], what an MTP block continues from. ``step``: the step's plan,
        built already (``graph_state``)."""
        if self.fg is not None:  # the group's row counts, for the split modules' padding
            self.fg.begin(input_ids.shape[0], logits_rows.shape[0], input_ids.device)
        step = self._step(meta, positions) if step is None else step
        rope = self._rope(positions)
        x = self._embed(self.w.embed, input_ids)  # [T, hidden]
        streams = x.unsqueeze(1).expand(-1, self.v4.hc_mult, -1).contiguous()  # [T, hc, hidden]
        for i, layer in enumerate(self.w.layers):
            streams = self._layer(i, self.v4.layer_types[i], layer, streams, kv_caches[i],
                                  step, rope, input_ids)
        if hidden_out is not None:
            hidden_out.append(streams.flatten(1))
        return self._logits(streams.index_select(0, logits_rows), self.w.hc_head,
                            self.w.final_norm, self.w.lm_head)

    @torch.inference_mode()
    def mtp_forward(
        self,
        index: int,  # which MTP block
        input_ids: torch.Tensor,  # [T]: token i + 1 for each row at position i
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, hc * hidden]: the target's streams (or the last MTP's)
        kv: KVCache,  # the MTP block's own cache (its window K=V)
        meta: AttentionMetadata,
        logits_rows: torch.Tensor,  # [B]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [B, V] float32, hidden [T, hc * hidden]
        """One MTP block over a flat varlen batch, as DeepSeek's ``MTPBlock`` runs it;
        :meth:`CausalLM.mtp_forward`'s interface. Returns the draft logits of
        ``logits_rows`` and every row's output streams, which a chained step continues
        from."""
        be, eps = self.backend, self.config.rms_norm_eps
        m = self.w.mtp[index]
        t, n = hidden.shape[0], self.v4.hc_mult
        e = self._embed(m.embed, input_ids).masked_fill((positions == 0).unsqueeze(-1), 0.0)
        e = be.linear(be.rms_norm(e, m.enorm, eps), m.e_proj)
        h = be.linear(be.rms_norm(hidden.view(t * n, -1), m.hnorm, eps), m.h_proj).view(t, n, -1)
        streams = self._layer(None, SLIDING, m.layer, h + e.unsqueeze(1), kv,
                              self._step(meta, positions, compressed=False),
                              self._rope(positions), input_ids)
        return (self._logits(streams.index_select(0, logits_rows), m.hc_head, m.norm, m.head),
                streams.flatten(1))

    def _rope(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {name: (cos.index_select(0, positions), sin.index_select(0, positions))
                for name, (cos, sin) in self.rope.items()}

    def _layer(self, i: int | None, kind: str, layer: V4LayerWeights, streams: torch.Tensor,
               cache: KVCache, step: Step, rope: dict, input_ids: torch.Tensor
               ) -> torch.Tensor:
        """One V4 layer on the streams [T, hc, hidden] (``i`` None: an MTP block's)."""
        be, eps = self.backend, self.config.rms_norm_eps
        self._lora_layer = i
        h, post, comb = self._hc_pre(streams, layer.attn_hc)
        if h.shape[0]:
            o = self._attention(kind, layer.attn, be.rms_norm(h, layer.attn_norm, eps), cache,
                                step, rope)
        else:  # a lockstep rank's idle forward: its collectives, nothing to attend
            o = h.new_zeros((0, layer.attn.o_b_width))
        h = self._o_proj(o, layer.attn.o_b)
        if self.tp is not None:  # the groups' partial projections summed
            self.tp.all_reduce(h)
        streams = _hc_post(streams, h, post, comb)
        h, post, comb = self._hc_pre(streams, layer.ffn_hc)
        h = self._moe(i, layer.mlp, be.rms_norm(h, layer.ffn_norm, eps), input_ids)
        if self.tp is not None:
            self.tp.all_reduce(h)
        return _hc_post(streams, h, post, comb)

    def _embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.fg is not None and self.fg.layout.shard("embedding") is not None:
            return self.fg.embed(table, ids)
        return table.index_select(0, ids) if self.tp is None else self.tp.embed(table, ids)

    def _o_proj(self, o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The grouped output projection's second half (wo_b) on o [T, groups * o_lora]:
        fine-grained TP's split by its input, or whole."""
        if self.fg is not None and self.fg.layout.shard("oproj") is not None:
            return self.fg.o_proj(o, w, self.backend)
        return self._lora_linear(o, w, "o_b")

    def _logits(self, streams: torch.Tensor, hc: HyperConnectionWeights, norm: torch.Tensor,
                head: torch.Tensor) -> torch.Tensor:
        last = self._hc_head(streams, hc)
        be = self.backend
        last = be.rms_norm(last, norm, self.config.rms_norm_eps)
        if self.fg is not None and self.fg.layout.shard("lmhead") is not None:
            return self.fg.lm_head(last, head, be)
        logits = be.linear(last, head).float()
        return logits if self.tp is None else self.tp.gather_logits(logits)

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows of ``hidden_out`` (streams, [T, hc * hidden]) -> the final normed hidden
        states the head reads, [T, hidden] (what pooling embeds)."""
        streams = hidden.view(hidden.shape[0], self.v4.hc_mult, -1)
        return self.backend.rms_norm(self._hc_head(streams, self.w.hc_head),
                                     self.w.final_norm, self.config.rms_norm_eps)

    # -- hyper-connections ----------------------------------------------------------------
    def _mixes(self, streams: torch.Tensor, hc: HyperConnectionWeights) -> torch.Tensor:
        flat = streams.flatten(1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return torch.mm(flat, hc.fn)

    def _hc_pre(self, streams: torch.Tensor, hc: HyperConnectionWeights
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Collapse the streams [T, n, hidden] into the block's input; return it with the
        weights that expand the block's output (post [T, n]) and mix the streams (comb
        [T, n, n], made doubly stochastic by Sinkhorn-Knopp)."""
        n, eps = self.v4.hc_mult, self.v4.hc_eps
        mixes = self._mixes(streams, hc)
        pre = torch.sigmoid(mixes[:, :n] * hc.scale[0] + hc.base[:n]) + eps
        post = 2 * torch.sigmoid(mixes[:, n:2 * n] * hc.scale[1] + hc.base[n:2 * n])
        comb = torch.softmax(mixes[:, 2 * n:].view(-1, n, n) * hc.scale[2]
                             + hc.base[2 * n:].view(n, n), dim=-1) + eps
        comb = self.backend.hc_sinkhorn(comb, self.v4.hc_sinkhorn_iters, eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)
        return collapsed, post, comb

    def _hc_head(self, streams: torch.Tensor, hc: HyperConnectionWeights) -> torch.Tensor:
        pre = torch.sigmoid(self._mixes(streams, hc) * hc.scale + hc.base) + self.v4.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)

    # -- attention ----------------------------------------------------------------------
    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary on the last rope_dim dims of x [T, N, D]."""
        r = self.v4.rope_dim
        return torch.cat((x[..., :-r], self.backend.rotary_embedding(x[..., -r:], cos, sin)),
                         dim=-1)

    def _attention(self, kind: str, w: V4AttentionWeights, x: torch.Tensor,
                   cache: KVCache, step: Step, rope: dict) -> torch.Tensor:
        be, v4, cfg = self.backend, self.v4, self.config
        eps = cfg.rms_norm_eps
        t, h, d = x.shape[0], cfg.num_heads, v4.head_dim
        cos, sin = rope["main" if kind == SLIDING else "compress"]
        parts = self._lora_linear(x, w.x_proj, "x").split(w.splits, dim=-1)
        q_res = be.rms_norm(parts[0], w.q_a_norm, eps)  # [T, q_lora]
        q = self._lora_linear(q_res, w.q_b, "q_b").view(t, h, d)
        q = be.head_rms_norm(q, self._ones, eps)  # unweighted, per head
        q = self._rotate(q, cos, sin)
        kv = self._rotate(be.rms_norm(parts[1], w.kv_norm, eps).unsqueeze(1), cos, sin)
        self._write(kv, cache, "window", step.write_slots)
        # the keys: (cache role, their rows [S, L], visible [S, Lq, L]) - the window's,
        # then the compressed entries'
        keys = [("window", step.window_slots, step.window_visible)]
        if w.compressor is not None:
            c = w.compressor
            plan = step.compression[(c.rate, c.overlap)]
            self._compress(c, parts[2], cache["state"], cache, "entries", plan, step)
            if w.index_compressor is None:  # HCA: every entry the query has seen
                keys.append(("entries", plan.entry_slots, plan.causal))
            else:
                ic = w.index_compressor
                self._compress(ic, parts[3], cache["index_state"], cache, "index_keys",
                               plan, step)
                ids, ok = self._index(w, q_res, parts[4], cache, plan, step, rope)
                if step.decode:  # the chosen entries alone (index_topk), not every entry
                    keys.append(("entries", plan.entry_slots.gather(1, ids[:, 0]), ok))
                else:
                    chosen = torch.zeros_like(plan.causal)
                    chosen.scatter_(-1, ids, ok)
                    keys.append(("entries", plan.entry_slots, chosen & plan.causal))
        if step.decode:  # the rows read where they lie (a kernel's), not gathered
            o = be.sink_attention_decode(
                q, [(cache[role], cache.get(role + "_scale"), slots, seen[:, 0])
                    for role, slots, seen in keys], w.sinks, self.scale)
        else:
            rows = torch.cat([self._read(cache, role, slots) for role, slots, _ in keys], 1)
            visible = torch.cat([seen for _, _, seen in keys], dim=-1)
            o = self._unpad(be.sink_attention(self._pad(q, step), rows, visible, w.sinks,
                                              self.scale), step)
        o = self._rotate(o, cos, -sin)  # undo K=V's rotation
        g = v4.o_groups
        o = torch.bmm(o.reshape(t, g, -1).transpose(0, 1), w.o_a)  # [g, T, o_lora]
        return o.transpose(0, 1).reshape(t, -1)  # (wo_b: _o_proj, outside the graph hole)

    def _write(self, x: torch.Tensor, cache: KVCache, role: str, slots: torch.Tensor
               ) -> None:
        """Rows x [T, 1, D] into their slots of the cache's ``role`` tensor (int8 with
        its scales under --kv-cache-dtype int8)."""
        scales = cache.get(role + "_scale")
        if scales is None:
            self.backend.write_cache(x, cache[role], slots)
        else:
            self.backend.write_int8_cache(x, cache[role], scales, slots)

    def _read(self, cache: KVCache, role: str, slots: torch.Tensor) -> torch.Tensor:
        """Rows of the cache's ``role`` tensor at flat slots [S, L] -> [S, L, D], in the
        model's dtype."""
        rows = _gather(cache[role], slots)
        scales = cache.get(role + "_scale")
        if scales is None:
            return rows
        return rows.to(self.dtype).mul_(_gather(scales, slots).to(self.dtype))

    def _compress(self, c: CompressorWeights, proj: torch.Tensor, state: torch.Tensor,
                  cache: KVCache, role: str, plan: Compression, step: Step) -> None:
        """Keep this step's compressor inputs (kv | gate + position bias, per token) and
        write the entry of every window this step closes into the cache's ``role``."""

        be = self.backend
        half = proj.shape[-1] // 2
        rows = proj.float()
        bias = c.ape.index_select(0, step.positions % c.rate)
        rows = torch.cat((rows[:, :half], rows[:, half:] + bias), dim=-1)
        flat = state.view(-1, state.shape[-1])
        flat.index_copy_(0, step.write_slots, rows)
        nw = plan.closing_dest.shape[0]
        if not nw:
            return
        got = flat.index_select(0, plan.closing_slots.view(-1)).view(nw, -1, flat.shape[-1])
        kv, gate = got[..., :half], got[..., half:]
        d, m = c.dim, c.rate
        if c.overlap:  # window w-1's first half, window w's second
            kv = torch.cat((kv[:, :m, :d], kv[:, m:, d:]), dim=1)
            gate = torch.cat((gate[:, :m, :d], gate[:, m:, d:]), dim=1)
        gate = gate.masked_fill(~plan.closing_valid.unsqueeze(-1), float("-inf"))
        entry = (kv * torch.softmax(gate, dim=1)).sum(1).to(self.dtype)  # [NW, d]
        entry = be.rms_norm(entry, c.norm, self.config.rms_norm_eps).unsqueeze(1)
        cos, sin = self.rope["compress"]
        entry = self._rotate(entry, cos.index_select(0, plan.closing_pos),
                             sin.index_select(0, plan.closing_pos))
        self._write(entry, cache, role, plan.closing_dest)

    def _index(self, w: V4AttentionWeights, q_res: torch.Tensor, weights: torch.Tensor,
               cache: KVCache, plan: Compression, step: Step, rope: dict
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The lightning indexer: each query's ``index_topk`` entries, scored
        sum_h w_h * relu(q_h . k); -> (entry ids [S, Lq, k], chosen [S, Lq, k] bool)."""
        v4 = self.v4
        assert w.index_q is not None
        t = q_res.shape[0]
        cos, sin = rope["compress"]
        q = self._rotate(self._lora_linear(q_res, w.index_q, "index_q").view(t, v4.index_heads, -1),
                         cos, sin)
        keys = self._read(cache, "index_keys", plan.entry_slots).float()  # [S, E, I]
        qp = self._pad(q, step).float()  # [S, nI, Lq, I]
        wp = self._pad(weights.float().unsqueeze(-1), step)[..., 0]  # [S, nI, Lq]
        scores = torch.relu(torch.matmul(qp, keys.transpose(1, 2).unsqueeze(1)))  # [S,nI,Lq,E]
        scores = (scores * (wp * (v4.index_head_dim ** -0.5 * v4.index_heads ** -0.5)
                            ).unsqueeze(-1)).sum(1)  # [S, Lq, E]
        scores = scores.masked_fill(~plan.causal, float("-inf"))
        # the k best, ties to the earlier entry: a stable sort, so a query's choice
        # depends on its own visible entries only (top-k's tie order can change with
        # how many masked entries follow - the chunking - and break causality)
        k = min(v4.index_topk, scores.shape[-1])
        ids = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
        return ids, scores.gather(-1, ids) > float("-inf")

    def _pad(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """[T, N, D] -> [S, N, Lq, D], zeros in padded rows."""
        if step.decode:
            return x.unsqueeze(2)
        if step.q_valid is None:
            return x.transpose(0, 1).unsqueeze(0)
        out = x.new_zeros((step.num_seqs, step.max_query, x.shape[1], x.shape[2]))
        out[step.q_valid] = x
        return out.transpose(1, 2)

    def _unpad(self, out: torch.Tensor, step: Step) -> torch.Tensor:
        if step.decode:
            return out[:, :, 0]
        out = out.transpose(1, 2)
        return out[0] if step.q_valid is None else out[step.q_valid]

    # -- MoE ----------------------------------------------------------------------------
    def route(self, w: MoEWeights, x: torch.Tensor, input_ids: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]): a hash layer's experts are its
        table's for the token (its router only weighs them); the others' the best
        scores plus the correction bias."""
        moe = self.config.moe
        assert moe is not None
        logits = torch.mm(x, w.router)
        if w.tid2eid is None:
            return self.backend.moe_gating_grouped_topk(
                logits, moe.top_k, 1, 1, w.correction_bias, moe.norm_topk_prob,
                moe.routed_scaling, moe.scoring)
        ids = w.tid2eid.index_select(0, input_ids)
        weights = score_experts(logits, moe.scoring).gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling, ids

    def _moe(self, layer: int | None, w: MoEWeights, x: torch.Tensor, input_ids: torch.Tensor
             ) -> torch.Tensor:
        """``layer`` None: an MTP block's, whose experts every rank holds whole."""
        be = self.backend
        weights, ids = self.route(w, x, input_ids)
        if self.load_recorder is not None and layer is not None:
            self._record_load(layer, ids)
        shared = w.shared
        assert isinstance(shared, DenseMLPWeights)

        def shared_mlp(rows: torch.Tensor) -> torch.Tensor:
            up = be.silu_and_mul(self._lora_linear(rows, shared.gate_up, "shared_gate_up"),
                                 self.limit)
            return self._lora_linear(up, shared.down, "shared_down")

        tp, ep = self.tp, self.ep if layer is not None else None
        if tp is not None and (ep is not None or not tp.shard.experts):
            # experts whole here (EP's slots, or an MTP block's under EP): each TP rank
            # its share of the tokens, joined by the all-reduce after the MoE
            def experts(rows: torch.Tensor, ws: torch.Tensor, ids_: torch.Tensor
                        ) -> torch.Tensor:
                if ep is not None:
                    return self._ep_moe(layer, rows, ws, ids_)
                return be.fused_moe(rows, w.w13, w.w2, ws.to(x.dtype), ids_, self.limit)

            out = tp.moe_on_share(x, weights, ids, experts,
                                  shared_mlp if self.shared_expert_dp else None)
            return out if self.shared_expert_dp else out + shared_mlp(x)
        if ep is not None:
            out = self._ep_moe(layer, x, weights, ids)
        else:
            out = be.fused_moe(x, w.w13, w.w2, weights.to(x.dtype), ids, self.limit)
        return out + shared_mlp(x)


def _hc_post(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor:
    """streams'[k] = post[k] * out + sum_j comb[j, k] * streams[j]."""
    dtype = streams.dtype
    return (post.to(dtype).unsqueeze(-1) * out.unsqueeze(1)
            + torch.bmm(comb.to(dtype).transpose(1, 2), streams))


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of a paged cache [blocks, slots, 1, D] at flat slots [S, L] -> [S, L, D]."""
    flat = cache.view(-1, cache.shape[-1])
    return flat.index_select(0, slots.reshape(-1)).view(*slots.shape, cache.shape[-1])
