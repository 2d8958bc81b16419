"""What the tiny models' trainers share (``make-tiny-model --train`` / ``--train-mtp``):
the serving model's computation made differentiable, and trained weights written back in
the checkpoint's own layout.

The forward is the serving code's where it can be (``CausalLM._attention`` with the
attention kernels themselves, over fresh sequences and a scratch cache; the norms), the
MLP in plain out-of-place torch ops (the serving kernels work in place), the same
arithmetic, experts picked by the frozen router. The write-back is the loader's
transforms inverted (``loader._read_layer`` and friends): a layer read and written back
is the checkpoint's, tensor for tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from pdmesh.shared.engine.model_runner import attention_metadata
from pdmesh.shared.kernels import AttentionMetadata
from pdmesh.shared.models.loader import mla_rows
from pdmesh.shared.models.transformer import (
    AttentionWeights,
    CausalLM,
    DenseMLPWeights,
    KVCache,
    LayerWeights,
    MLAWeights,
    MoEWeights,
)

Leaf = Callable[[torch.Tensor | None], torch.Tensor | None]

# the MLA tensors trained (the loader's form; ``mla_checkpoint`` writes them back)
ATTENTION = ("q", "q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "w_uk", "w_uv", "o")


def leaf(x: torch.Tensor | None) -> torch.Tensor | None:
    """A trainable copy of a loaded tensor (None stays None)."""
    return None if x is None else x.detach().clone().requires_grad_()


@dataclasses.dataclass
class Batch:
    """Fresh sequences laid out in their own blocks of a scratch cache: block table row k
    holds sequence k, its tokens from position 0."""

    ids: torch.Tensor  # [T] int64, the sequences one after another
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    starts: np.ndarray  # [B + 1] int32: where each sequence's rows begin (query_start_loc)

    @classmethod
    def of(cls, seqs: list[list[int]], block_size: int, width: int) -> Batch:
        """``width``: blocks per sequence in the scratch cache (``scratch_cache``)."""
        n = [len(s) for s in seqs]
        table = np.arange(1, 1 + len(seqs) * width, dtype=np.int32).reshape(len(seqs), width)
        pos = np.concatenate([np.arange(k, dtype=np.int64) for k in n])
        seq = np.repeat(np.arange(len(seqs)), n)
        slots = table[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
        qsl = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(n, out=qsl[1:])
        meta = attention_metadata(torch.device("cpu"), table, [0] * len(seqs), n, n, pos,
                                  slots, qsl, block_size)
        ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs])
        return cls(torch.from_numpy(ids), torch.from_numpy(pos), meta, qsl)


def scratch_cache(like: KVCache, blocks: int) -> KVCache:
    """A zeroed cache of ``blocks`` blocks (plus the null block 0) shaped as ``like``."""
    return {role: torch.zeros((blocks + 1, *x.shape[1:]), dtype=x.dtype)
            for role, x in like.items()}


def layer_forward(model: CausalLM, layer: LayerWeights, x: torch.Tensor, positions: torch.Tensor,
                  cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
    """One decoder layer, differentiable (``CausalLM.forward``'s body for one layer):
    x + attention, then + MLP. ``cache``: a fresh scratch cache, written and read."""
    be, eps = model.backend, model.config.rms_norm_eps
    a = model._attention(layer.attn, be.rms_norm(x, layer.input_norm, eps),
                         model.cos.index_select(0, positions),
                         model.sin.index_select(0, positions),
                         {role: torch.zeros_like(c) for role, c in cache.items()}, meta)
    r = x + a
    return r + mlp_forward(model, layer.mlp, be.rms_norm(r, layer.post_attn_norm, eps))


def trainable_attention(w: AttentionWeights | MLAWeights, make: Leaf
                        ) -> AttentionWeights | MLAWeights:
    if isinstance(w, MLAWeights):
        return dataclasses.replace(w, **{name: make(getattr(w, name)) for name in ATTENTION})
    return dataclasses.replace(w, qkv=make(w.qkv), qkv_bias=make(w.qkv_bias), o=make(w.o),
                               qk_norm=make(w.qk_norm))


def trainable_mlp(w: DenseMLPWeights | MoEWeights, make: Leaf) -> DenseMLPWeights | MoEWeights:
    """The MLP's weights as ``make`` makes them (the router, its bias and hash table
    stay frozen)."""
    if isinstance(w, DenseMLPWeights):
        return DenseMLPWeights(make(w.gate_up), make(w.down))
    shared = None if w.shared is None else trainable_mlp(w.shared, make)
    return dataclasses.replace(w, w13=make(w.w13), w2=make(w.w2), shared=shared)


def mlp_tensors(w: DenseMLPWeights | MoEWeights) -> list[torch.Tensor]:
    if isinstance(w, DenseMLPWeights):
        return [w.gate_up, w.down]
    return [w.w13, w.w2, *([] if w.shared is None else mlp_tensors(w.shared))]


def attention_tensors(w: AttentionWeights | MLAWeights) -> list[torch.Tensor]:
    names = ATTENTION if isinstance(w, MLAWeights) else ("qkv", "qkv_bias", "o", "qk_norm")
    return [x for x in (getattr(w, n) for n in names) if x is not None]


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = torch.mm(x, gate_up).chunk(2, dim=-1)
    return torch.mm(F.silu(gate) * up, down)


def mlp_forward(model: CausalLM, w: DenseMLPWeights | MoEWeights, x: torch.Tensor
                ) -> torch.Tensor:
    """``CausalLM._mlp`` in out-of-place torch ops."""
    if isinstance(w, DenseMLPWeights):
        return _swiglu(x, w.gate_up, w.down)
    with torch.no_grad():
        weights, ids = model._route(w, x.detach())
    out = torch.zeros_like(x)
    for e in range(w.w13.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if len(token):
            y = _swiglu(x[token], w.w13[e], w.w2[e]) * weights[token, slot, None].to(x.dtype)
            out = out.index_add(0, token, y)
    if w.shared is not None:
        out = out + mlp_forward(model, w.shared, x)
    return out


def layer_checkpoint(model: CausalLM, layer: LayerWeights, stored: dict[str, torch.Tensor],
                     p: str) -> dict[str, torch.Tensor]:
    """A decoder layer's tensors under the checkpoint's names (prefix ``p``,
    ``model.layers.{i}.``), [out, in]."""
    out = {p + "input_layernorm.weight": layer.input_norm.detach().clone(),
           p + "post_attention_layernorm.weight": layer.post_attn_norm.detach().clone()}
    attn = (mla_checkpoint(model.config, layer.attn) if isinstance(layer.attn, MLAWeights)
            else gqa_checkpoint(model, layer.attn, stored, p + "self_attn."))
    out.update({p + "self_attn." + key: w for key, w in attn.items()})
    out.update(mlp_checkpoint(layer.mlp, stored, p + "mlp."))
    return out


def gqa_checkpoint(model: CausalLM, w: AttentionWeights, stored: dict[str, torch.Tensor],
                   p: str) -> dict[str, torch.Tensor]:
    """q|k|v split again, [out, in]; the per-head norms back to one vector each (the
    loader expands q_norm / k_norm over the heads; ``tie_qk_norm`` keeps the copies
    equal)."""
    cfg = model.config
    q, kv = model.q_size, model.kv_size
    qkv = w.qkv.detach().t()
    out = {"q_proj.weight": qkv[:q], "k_proj.weight": qkv[q:q + kv],
           "v_proj.weight": qkv[q + kv:], "o_proj.weight": w.o.detach().t()}
    if w.qkv_bias is not None:
        b = w.qkv_bias.detach()
        out.update({"q_proj.bias": b[:q], "k_proj.bias": b[q:q + kv], "v_proj.bias": b[q + kv:]})
    if w.qk_norm is not None:
        n = w.qk_norm.detach()
        out["q_norm.weight"] = n[0]
        out["k_norm.weight"] = n[cfg.num_heads]
    return {key: x.contiguous() for key, x in out.items() if p + key in stored}


def tie_qk_norm(layers: list[LayerWeights], num_heads: int) -> None:
    """After an optimizer step: every query head's norm the mean of theirs, every key
    head's likewise (the checkpoint has one of each; the gradients differ per head)."""
    with torch.no_grad():
        for layer in layers:
            n = getattr(layer.attn, "qk_norm", None)
            if n is not None:
                n[:num_heads] = n[:num_heads].mean(0)
                n[num_heads:] = n[num_heads:].mean(0)


def mla_checkpoint(cfg, w: MLAWeights) -> dict[str, torch.Tensor]:
    """MLA weights in the loader's form back in the checkpoint's: [out, in], the rotary
    dims interleaved again where the checkpoint has them so, kv_b from W_UK and W_UV.
    (The inverse of ``loader._read_mla``.)"""
    lat = cfg.mla.kv_lora_rank
    q_rows, kv_rows = mla_rows(cfg)

    def unpermute(loaded: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(loaded.t())
        out[rows] = loaded.detach().t()
        return out.contiguous()

    out = {"kv_a_proj_with_mqa.weight": unpermute(w.kv_a, kv_rows),
           "kv_a_layernorm.weight": w.kv_a_norm.detach().clone(),
           "kv_b_proj.weight": torch.cat((w.w_uk.detach(), w.w_uv.detach().transpose(1, 2)),
                                         dim=1).reshape(-1, lat).contiguous(),
           "o_proj.weight": w.o.detach().t().contiguous()}
    if w.q is not None:
        out["q_proj.weight"] = unpermute(w.q, q_rows)
    else:
        out["q_a_proj.weight"] = w.q_a.detach().t().contiguous()
        out["q_a_layernorm.weight"] = w.q_a_norm.detach().clone()
        out["q_b_proj.weight"] = unpermute(w.q_b, q_rows)
    return out


def mlp_checkpoint(w: DenseMLPWeights | MoEWeights, stored: dict[str, torch.Tensor],
                   p: str) -> dict[str, torch.Tensor]:
    """The MLP's trained tensors under the checkpoint's names, [out, in]."""

    def dense(d: DenseMLPWeights, q: str) -> dict[str, torch.Tensor]:
        gate, up = d.gate_up.detach().t().chunk(2, dim=0)
        return {q + "gate_proj.weight": gate.contiguous(), q + "up_proj.weight": up.contiguous(),
                q + "down_proj.weight": d.down.detach().t().contiguous()}

    if isinstance(w, DenseMLPWeights):
        return dense(w, p)
    out = {} if w.shared is None else dense(w.shared, p + "shared_experts.")
    w13, w2 = w.w13.detach().transpose(1, 2), w.w2.detach().transpose(1, 2)  # [E, out, in]
    if p + "experts.gate_up_proj" in stored:
        out[p + "experts.gate_up_proj"] = w13.contiguous()
        out[p + "experts.down_proj"] = w2.contiguous()
        return out
    for e in range(w13.shape[0]):
        gate, up = w13[e].chunk(2, dim=0)
        out[f"{p}experts.{e}.gate_proj.weight"] = gate.contiguous()
        out[f"{p}experts.{e}.up_proj.weight"] = up.contiguous()
        out[f"{p}experts.{e}.down_proj.weight"] = w2[e].contiguous()
    return out
