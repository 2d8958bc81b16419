"""Which Hugging Face architectures pdmesh runs, and what sets them apart.

All of them are the same pre-norm decoder (:mod:`pdmesh.shared.models.transformer`); the
traits below switch its differences on (DeepSeek-V3's latent attention and DeepSeekMoE
routing included).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchitectureTraits:
    qkv_bias: bool = False  # Qwen2: biases on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before rotary
    moe: bool = False  # Qwen3-MoE: routed experts instead of the dense MLP
    mla: bool = False  # DeepSeek-V2/V3: multi-head latent attention, a latent KV cache
    v4: bool = False  # DeepSeek-V4: sliding + compressed attention, hyper-connections


ARCHITECTURES: dict[str, ArchitectureTraits] = {
    "LlamaForCausalLM": ArchitectureTraits(),
    "MistralForCausalLM": ArchitectureTraits(),
    "Qwen2ForCausalLM": ArchitectureTraits(qkv_bias=True),
    "Qwen3ForCausalLM": ArchitectureTraits(qk_norm=True),
    "Qwen3MoeForCausalLM": ArchitectureTraits(qk_norm=True, moe=True),
    "DeepseekV3ForCausalLM": ArchitectureTraits(moe=True, mla=True),
    "DeepseekV4ForCausalLM": ArchitectureTraits(moe=True, v4=True),
}


def architecture_traits(name: str) -> ArchitectureTraits:
    if name not in ARCHITECTURES:
        raise ValueError(
            f"config.json: unsupported architecture {name!r}; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[name]
