"""DeepSeek-V4's LoRA sites.

An adapter names transformers' modules (PEFT over ``DeepseekV4ForCausalLM``:
``model.layers.{i}.self_attn.q_a_proj``, ...) or DeepSeek's own (``layers.{i}.attn.wq_a``,
...). pdmesh computes everything the attention draws from its input in one projection,
``x_proj``, so those modules are parts of one site, as many as the layer has::

    q_a_proj | kv_proj                    (wq_a | wkv)                  -> x, q_a kv
    compressor.{kv,gate}_proj             (compressor.{wkv,wgate})      -> x  (HCA, CSA)
    compressor.indexer.{kv,gate}_proj,    (indexer.compressor.{wkv,wgate},
      compressor.indexer.scorer.weights_proj   indexer.weights_proj)    -> x  (CSA)
    q_b_proj                              (wq_b)                        -> q_b
    compressor.indexer.q_b_proj           (indexer.wq_b)                -> index_q
    o_b_proj                              (wo_b)                        -> o_b
    mlp.shared_experts.{gate,up}_proj     (ffn.shared_experts.{w1,w3})  -> shared_gate_up
    mlp.shared_experts.down_proj          (ffn.shared_experts.w2)       -> shared_down

Rows the loader puts in rotate-half order (the rope dims of q's heads, of K=V, of the
compressors' and the indexer's outputs) are reordered in B alike. Refused, naming the
module: o_a_proj (one projection per head group: a LoRA's single A and B is not one),
routed experts and the router.
"""

from __future__ import annotations

import torch

# x_proj's parts, in its column order (a layer has the first 2, 4 or 7 of them)
X_PARTS = ("q_a", "kv", "compressor.kv", "compressor.gate", "indexer.kv", "indexer.gate",
           "indexer.weights")
_A, _C, _I = "self_attn.", "self_attn.compressor.", "self_attn.compressor.indexer."
# module (after the layer's prefix), transformers' and DeepSeek's -> (site, part)
_NAMES: dict[str, tuple[str, str | int]] = {}
for _ours, _theirs, _at in (
        (_A + "q_a_proj", "attn.wq_a", ("x", "q_a")),
        (_A + "kv_proj", "attn.wkv", ("x", "kv")),
        (_C + "kv_proj", "attn.compressor.wkv", ("x", "compressor.kv")),
        (_C + "gate_proj", "attn.compressor.wgate", ("x", "compressor.gate")),
        (_I + "kv_proj", "attn.indexer.compressor.wkv", ("x", "indexer.kv")),
        (_I + "gate_proj", "attn.indexer.compressor.wgate", ("x", "indexer.gate")),
        (_I + "scorer.weights_proj", "attn.indexer.weights_proj", ("x", "indexer.weights")),
        (_A + "q_b_proj", "attn.wq_b", ("q_b", 0)),
        (_I + "q_b_proj", "attn.indexer.wq_b", ("index_q", 0)),
        (_A + "o_b_proj", "attn.wo_b", ("o_b", 0)),
        ("mlp.shared_experts.gate_proj", "ffn.shared_experts.w1", ("shared_gate_up", 0)),
        ("mlp.shared_experts.up_proj", "ffn.shared_experts.w3", ("shared_gate_up", 1)),
        ("mlp.shared_experts.down_proj", "ffn.shared_experts.w2", ("shared_down", 0))):
    _NAMES[_ours] = _NAMES[_theirs] = _at
_WHY_NOT = {
    _A + "o_a_proj": "the grouped output projection: one projection per head group",
    "attn.wo_a": "the grouped output projection: one projection per head group",
    "mlp.experts": "routed experts", "ffn.experts": "routed experts",
    "mlp.gate": "the router", "ffn.gate": "the router",
}
SITES = {"x": None, "q_b": 1, "index_q": 1, "o_b": 1}  # (x: as many parts as the layer has)


def x_parts(attn) -> list[str]:
    """The parts of x_proj a layer's attention (V4AttentionWeights) has."""
    count = 2 + 2 * (attn.compressor is not None) + 3 * (attn.index_compressor is not None)
    return list(X_PARTS[:count])


def site_of(module: str, inner: str, layer: int, lw) -> tuple[str, int]:
    """(site, part) of ``inner`` (a module's name inside layer ``layer``, whose weights
    are ``lw``); ValueError naming ``module`` when pdmesh cannot apply a LoRA there."""
    at = _NAMES.get(inner)
    if at is None:
        why = next((w for prefix, w in _WHY_NOT.items() if inner.startswith(prefix)),
                   "not a projection pdmesh applies LoRA to")
        raise ValueError(f"target_modules: {module}: LoRA on this module is not supported "
                         f"({why})")
    site, part = at
    if site == "x":
        parts = x_parts(lw.attn)
        if part not in parts:
            raise ValueError(f"target_modules: {module}: layer {layer} has no {part} "
                             "(not a compressed layer of that kind)")
        return site, parts.index(part)
    if site == "index_q" and lw.attn.index_q is None:
        raise ValueError(f"target_modules: {module}: layer {layer} has no indexer")
    return site, int(part)


def site_weight(lw, site: str):
    """The base weight of a site in a V4LayerWeights (None when the layer lacks it)."""
    shared = lw.mlp.shared
    return {"x": lw.attn.x_proj, "q_b": lw.attn.q_b, "index_q": lw.attn.index_q,
            "o_b": lw.attn.o_b, "shared_gate_up": shared.gate_up if shared else None,
            "shared_down": shared.down if shared else None}.get(site)


def x_widths(attn) -> list[int]:
    """The output width of each of x_proj's parts (the compressors' kv | gate halves)."""
    s = attn.splits
    widths = [s[0], s[1]]
    for split in s[2:4]:
        widths += [split // 2, split // 2]
    return widths + list(s[4:])


def output_rows(model, layer: int, site: str, part: int) -> torch.Tensor | None:
    """The checkpoint rows, in the loader's order, of a site's part whose outputs the
    loader reorders; None where it keeps them."""
    from pdmesh.shared.models.loader import rope_rows

    v4 = model.config.v4
    r = v4.rope_dim
    if site == "q_b":
        return rope_rows(v4.head_dim, r, model.config.num_heads)
    if site == "index_q":
        return rope_rows(v4.index_head_dim, r, v4.index_heads)
    if site != "x":
        return None
    attn = model.w.layers[layer].attn
    name = x_parts(attn)[part]
    if name in ("q_a", "indexer.weights"):
        return None
    if name == "kv":
        return rope_rows(v4.head_dim, r)
    c = attn.compressor if name.startswith("compressor.") else attn.index_compressor
    return rope_rows(c.dim, r, 1 + c.overlap)
