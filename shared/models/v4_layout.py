"""DeepSeek-V4 checkpoints in transformers' layout, read under DeepSeek's own names.

transformers renames DeepSeek's tensors when it loads them (its conversion mapping for
deepseek_v4: ``attn`` -> ``self_attn``, ``wq_a`` -> ``q_a_proj``, ``hc_attn_fn`` ->
``attn_hc.fn``, every layer's experts fused into ``mlp.experts.gate_up_proj`` [E, 2I, H]
and ``down_proj`` [E, H, I], all under ``model.``). A fine-tune saved from its state dict
keeps those names; ``save_pretrained`` maps most of them back but keeps the ``model.``
prefix, ``model.embed_tokens`` and ``model.hc_head.hc_*``, and writes the attention's
``kv_norm`` as ``attn.norm``. Either is read here as DeepSeek's layout (the one the
official releases ship): each tensor under its official name, each fused expert stack
as its experts' ``w1`` / ``w3`` / ``w2``."""

from __future__ import annotations

import re
from typing import Any

import torch

_WHOLE = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
          "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
          "hc_head.hc_scale": "hc_head_scale"}
# transformers' name -> DeepSeek's, in order (each on what the ones before made)
_RULES = [(re.compile(a), b) for a, b in (
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.norm\.", ".attn.kv_norm."),  # (save_pretrained's name for it)
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
)]
_FUSED = re.compile(r"^(.*)\.ffn\.experts\.(gate_up_proj|down_proj)$")


def is_transformers_layout(names: list[str]) -> bool:
    return any(n.startswith("model.") for n in names)


def official_names(names: list[str], shape_of) -> dict[str, tuple[str, tuple | None]]:
    """DeepSeek's name -> (the stored name, what to take of it: None for all, or
    (expert, rows) of a fused stack). ``shape_of(stored)``: its shape."""
    out: dict[str, tuple[str, tuple | None]] = {}
    for stored in names:
        name = stored.removeprefix("model.")
        if name in _WHOLE:
            out[_WHOLE[name]] = (stored, None)
            continue
        for pattern, replacement in _RULES:
            name = pattern.sub(replacement, name)
        fused = _FUSED.match(name)
        if fused is None:
            out[name] = (stored, None)
            continue
        prefix, which = fused.groups()
        experts, rows, _ = shape_of(stored)
        for e in range(experts):
            base = f"{prefix}.ffn.experts.{e}."
            if which == "down_proj":
                out[base + "w2.weight"] = (stored, (e, slice(None)))
            else:  # gate | up along the rows
                half = rows // 2
                out[base + "w1.weight"] = (stored, (e, slice(0, half)))
                out[base + "w3.weight"] = (stored, (e, slice(half, rows)))
    return out


class Renamed:
    """A safe_open handle as the reader uses it (``get_tensor``, ``get_slice``), for one
    tensor under another name, or one expert's rows of a fused stack."""

    def __init__(self, handle: Any, stored: str, select: tuple | None):
        self.handle, self.stored, self.select = handle, stored, select

    def get_tensor(self, _name: str) -> torch.Tensor:
        if self.select is None:
            return self.handle.get_tensor(self.stored)
        expert, rows = self.select
        return self.handle.get_slice(self.stored)[expert:expert + 1, rows].squeeze(0).clone()

    def get_slice(self, _name: str) -> _Slice:
        return _Slice(self)


class _Slice:
    def __init__(self, of: Renamed):
        self.of = of

    def get_dtype(self) -> str:
        return self.of.handle.get_slice(self.of.stored).get_dtype()

    def get_shape(self) -> list[int]:
        shape = self.of.handle.get_slice(self.of.stored).get_shape()
        if self.of.select is None:
            return list(shape)
        rows = self.of.select[1]
        return [len(range(*rows.indices(shape[1]))), *shape[2:]]

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.of.get_tensor("")[index]
