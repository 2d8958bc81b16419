"""A model folder's config.json, read into one frozen dataclass.

Field names follow Hugging Face's; the spellings that differ between transformers
releases (``rope_theta`` vs ``rope_parameters``, ``num_experts`` vs
``num_local_experts``, ``torch_dtype`` vs ``dtype``) are reconciled here, once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                 "half": "float16"}


def parse_dtype(name: str | torch.dtype | None, default: str = "float32") -> torch.dtype:
    """``--dtype`` value -> torch dtype; ValueError naming the field otherwise."""
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"dtype: unsupported {name}; use float32, bfloat16 or float16")
        return name
    if name in (None, "auto"):
        name = default
    key = DTYPE_ALIASES.get(str(name), str(name))
    if key not in DTYPES:
        raise ValueError(f"dtype: unsupported {name!r}; use auto, float32, bfloat16 or float16")
    return DTYPES[key]


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    # layer i is MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    dtype: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    rope_scaling: dict[str, Any] | None = None
    moe: MoEConfig | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        from pdmesh.shared.models.registry import architecture_traits

        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json: missing 'architectures'")
        arch = archs[0]
        traits = architecture_traits(arch)
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if key not in cfg:
                raise ValueError(f"config.json: missing {key!r} (architecture {arch})")
        heads = int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default")
                                              not in ("default", None) else None)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        moe = None
        if traits.moe:
            n_exp = cfg.get("num_experts", cfg.get("num_local_experts"))
            if n_exp is None:
                raise ValueError(f"config.json: missing 'num_experts' (architecture {arch})")
            moe = MoEConfig(
                num_experts=int(n_exp),
                top_k=int(cfg["num_experts_per_tok"]),
                intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
                mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            )
        return cls(
            architecture=arch,
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg.get("intermediate_size", 4 * cfg["hidden_size"])),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=traits.qkv_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=traits.qk_norm,
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            rope_scaling=scaling,
            moe=moe,
            raw=cfg,
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"model: {p} not found (a model folder needs config.json)")
        with open(p) as f:
            return cls.from_dict(json.load(f))
