"""LoRA adapters in PEFT's format, read for pdmesh's projections.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or
``adapter_model.bin``, refused: pickles are not read). Each targeted ``nn.Linear`` of the
base model has ``lora_A`` [r, in] and ``lora_B`` [out, r]; the module's output gains
``scaling * x @ A.T @ B.T``, scaling = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).

pdmesh's projections fuse some of the checkpoint's modules, so an adapter is read per
*site* (a projection of one layer) and *part* (the module inside it)::

    q_proj | k_proj | v_proj          -> qkv, parts 0 1 2
    o_proj                            -> o
    gate_proj | up_proj               -> gate_up, parts 0 1   (dense MLPs)
    down_proj                         -> down
    shared_experts.{gate,up,down}     -> shared_gate_up, shared_down
    MLA: q_proj, q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj -> q, q_a, q_b, kv_a, o
    DeepSeek-V4: see :mod:`pdmesh.shared.models.lora_v4`

Output rows the loader reorders (MLA's interleaved rotary dims) are reordered in B alike.
Refused, naming the module or key: MLA's kv_b_proj (absorbed into the attention), routed
experts, the router, embeddings and lm_head, modules_to_save, biases, DoRA, fan_in_fan_out,
layers_to_transform, a rank above ``max_rank``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdmesh.shared.models import lora_v4

# module name (after "model.layers.{i}.") -> (site, part) for each attention kind
_ATTENTION = {"self_attn.q_proj": ("qkv", 0), "self_attn.k_proj": ("qkv", 1),
              "self_attn.v_proj": ("qkv", 2), "self_attn.o_proj": ("o", 0)}
_LATENT = {"self_attn.q_proj": ("q", 0), "self_attn.q_a_proj": ("q_a", 0),
           "self_attn.q_b_proj": ("q_b", 0), "self_attn.kv_a_proj_with_mqa": ("kv_a", 0),
           "self_attn.o_proj": ("o", 0)}
_DENSE = {"mlp.gate_proj": ("gate_up", 0), "mlp.up_proj": ("gate_up", 1),
          "mlp.down_proj": ("down", 0)}
_SHARED = {"mlp.shared_experts.gate_proj": ("shared_gate_up", 0),
           "mlp.shared_experts.up_proj": ("shared_gate_up", 1),
           "mlp.shared_experts.down_proj": ("shared_down", 0)}
# the parts each site has (the width of its output blocks comes from the model; None:
# as many as the layer has)
SITE_PARTS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1, "shared_gate_up": 2,
              "shared_down": 1, "q": 1, "q_a": 1, "q_b": 1, "kv_a": 1, **lora_v4.SITES}
_WHY_NOT = {
    "self_attn.kv_b_proj": "it is absorbed into the latent attention's query and output",
    "mlp.gate": "the router",
    "mlp.experts": "routed experts",
}
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass
class LoraWeights:
    """One site's LoRA of one adapter: per part (None where the adapter leaves it), A
    [in, r] and B [r, out], the scaling folded into B."""

    parts: list[tuple[torch.Tensor, torch.Tensor] | None]


@dataclass
class Adapter:
    """An adapter read for one model: ``sites[(layer, site)]``; ``digest`` identifies its
    weights and scalings (what a request's KV keys carry)."""

    name: str
    path: str
    rank: int  # the largest of its modules' ranks
    sites: dict[tuple[int, str], LoraWeights] = field(default_factory=dict)
    digest: str = ""


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key matching the module's name
    (a whole dotted suffix, or a regular expression over it)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_config(folder: Path, max_rank: int) -> dict:
    """adapter_config.json, checked: ValueError naming the key pdmesh cannot honour."""
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"lora_path: {folder} has no adapter_config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"lora_path: {path} is not JSON: {e}") from e
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"peft_type: {cfg.get('peft_type')!r}; only LORA adapters are served")
    for key, why in (("modules_to_save", "whole modules replaced by the adapter"),
                     ("layers_to_transform", "an adapter limited to some layers"),
                     ("layers_pattern", "an adapter limited to some layers")):
        if cfg.get(key):
            raise ValueError(f"{key}: {cfg[key]!r} is not supported ({why})")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"bias: {cfg['bias']!r}: adapters with biases are not supported")
    if cfg.get("use_dora"):
        raise ValueError("use_dora: DoRA adapters are not supported")
    if cfg.get("fan_in_fan_out"):
        raise ValueError("fan_in_fan_out: only nn.Linear adapters (fan_in_fan_out false)")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"r: must be a positive integer, got {r!r}")
    ranks = [r, *(cfg.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        raise ValueError(f"r: the adapter's rank {max(ranks)} is above --max-lora-rank "
                         f"({max_rank})")
    return cfg


def _site_of(module: str, model) -> tuple[int, str, int]:
    """(layer, site, part) of a checkpoint module path; ValueError naming it when pdmesh
    cannot apply a LoRA there."""
    v4 = model.config.v4 is not None
    m = re.match(r"^(model\.)?layers\.(\d+)\.(.+)$", module)
    if m is None or (m.group(1) is None and not v4):  # (V4: DeepSeek's names too)
        raise ValueError(f"target_modules: {module}: LoRA on this module is not supported "
                         "(only the decoder layers' projections)")
    layer, inner = int(m.group(2)), m.group(3)
    if layer >= len(model.w.layers):
        raise ValueError(f"{module}: the model has {len(model.w.layers)} layers")
    if v4:
        return layer, *lora_v4.site_of(module, inner, layer, model.w.layers[layer])
    latent, shared = model.config.mla is not None, _has_shared(model)
    table = {**(_LATENT if latent else _ATTENTION), **_DENSE, **(_SHARED if shared else {})}
    if inner in table:
        site, part = table[inner]
        return layer, site, part
    why = next((w for prefix, w in _WHY_NOT.items() if inner.startswith(prefix)),
               "not a projection pdmesh applies LoRA to")
    raise ValueError(f"target_modules: {module}: LoRA on this module is not supported ({why})")


def read_adapter(name: str, folder: str | Path, model, max_rank: int,
                 dtype: torch.dtype) -> Adapter:
    """The adapter at ``folder`` for ``model`` (a CausalLM: its config and weights give
    the sites and their widths). ValueError naming the key, module or shape that does
    not fit; nothing is half-read."""
    from safetensors import SafetensorError, safe_open

    root = Path(folder)
    cfg = read_config(root, max_rank)
    weights = root / "adapter_model.safetensors"
    if not weights.is_file():
        extra = " (adapter_model.bin is not read: pickles)" if (
            root / "adapter_model.bin").is_file() else ""
        raise ValueError(f"lora_path: {root} has no adapter_model.safetensors{extra}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps({k: cfg.get(k) for k in ("r", "lora_alpha", "use_rslora",
                                                      "rank_pattern", "alpha_pattern")},
                             sort_keys=True).encode())
    try:
        with safe_open(str(weights), framework="pt") as f:
            for key in sorted(f.keys()):
                m = _KEY.match(key)
                if m is None:
                    if "lora_embedding" in key or "lora_magnitude" in key:
                        raise ValueError(f"{key}: embedding and DoRA adapters are not supported")
                    raise ValueError(f"{key}: not a LoRA weight pdmesh reads (lora_A / lora_B of "
                                     "a linear module)")
                t = f.get_tensor(key)
                digest.update(key.encode())
                digest.update(t.float().numpy().tobytes())
                pairs.setdefault(m.group("module"), {})[m.group("ab")] = t
    except (OSError, SafetensorError) as e:
        raise ValueError(f"lora_path: {weights} cannot be read: {e}") from e
    adapter = Adapter(name, str(root), 1, digest=digest.hexdigest())
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{module}: has lora_{'A' if 'A' in ab else 'B'} only")
        layer, site, part = _site_of(module, model)
        _add(adapter, model, cfg, module, layer, site, part, ab["A"], ab["B"], dtype)
    if not adapter.sites:
        raise ValueError(f"lora_path: {root}: the adapter has no LoRA weights")
    return adapter


def _has_shared(model) -> bool:
    return any(getattr(lw.mlp, "shared", None) is not None for lw in model.w.layers)


def _add(adapter: Adapter, model, cfg: dict, module: str, layer: int, site: str, part: int,
         a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """One module's A [r, in] and B [out, r] into its site, checked against the model."""
    r = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
        raise ValueError(f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do "
                         "not make a rank-r update")
    k, widths = site_shape(model, layer, site)
    if a.shape[1] != k or b.shape[0] != widths[part]:
        raise ValueError(f"{module}: lora_A {list(a.shape)} / lora_B {list(b.shape)}, the "
                         f"model's module is [{widths[part]}, {k}]")
    alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module, cfg.get("lora_alpha", r))
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    rows = output_rows(model, layer, site, part)
    if rows is not None:
        b = b[rows]
    entry = adapter.sites.setdefault((layer, site), LoraWeights([None] * len(widths)))
    entry.parts[part] = (a.t().to(dtype).contiguous(),
                         (b.t().float() * scaling).to(dtype).contiguous())
    adapter.rank = max(adapter.rank, r)


def site_shape(model, layer: int, site: str) -> tuple[int, list[int]]:
    """(input width, output width of each part) of a site of ``model``'s layer; KeyError
    for a site the layer does not have (ValueError from the caller's view)."""
    lw = model.w.layers[layer]
    weight = site_weight(lw, site)
    if weight is None:
        raise ValueError(f"model.layers.{layer}: has no {site} projection for a LoRA")
    k, n = weight.shape[0], weight.shape[1]
    if site == "x":
        return k, lora_v4.x_widths(lw.attn)
    parts = SITE_PARTS[site]
    if site == "qkv":
        q = model.q_size
        kv = (n - q) // 2
        return k, [q, kv, kv]
    return k, [n // parts] * parts


def site_weight(lw, site: str):
    """The base weight of a site in a LayerWeights (None when the layer lacks it)."""
    if hasattr(lw.attn, "x_proj"):  # DeepSeek-V4's
        return lora_v4.site_weight(lw, site)
    mlp = lw.mlp
    dense = mlp if hasattr(mlp, "gate_up") else None
    shared = getattr(mlp, "shared", None)
    return {"qkv": getattr(lw.attn, "qkv", None), "o": lw.attn.o,
            "q": getattr(lw.attn, "q", None), "q_a": getattr(lw.attn, "q_a", None),
            "q_b": getattr(lw.attn, "q_b", None), "kv_a": getattr(lw.attn, "kv_a", None),
            "gate_up": dense.gate_up if dense is not None else None,
            "down": dense.down if dense is not None else None,
            "shared_gate_up": shared.gate_up if shared is not None else None,
            "shared_down": shared.down if shared is not None else None}.get(site)


def output_rows(model, layer: int, site: str, part: int) -> torch.Tensor | None:
    """The checkpoint rows, in the loader's order, of a site's part whose outputs the
    loader reorders (MLA's and DeepSeek-V4's interleaved rotary dims); None where it
    keeps them."""
    if model.config.v4 is not None:
        return lora_v4.output_rows(model, layer, site, part)
    if model.config.mla is None or site not in ("q", "q_b", "kv_a"):
        return None
    from pdmesh.shared.models.loader import mla_rows

    q_rows, kv_rows = mla_rows(model.config)
    return kv_rows if site == "kv_a" else q_rows
