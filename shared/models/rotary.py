"""Rotary position tables (cos/sin per position), computed once at load.

The math matches Hugging Face's default, "linear", "llama3" and "yarn" rope:
frequencies in float32, ``emb = cat(freqs, freqs)``, so a [max_pos, head_dim] table
indexed by position gives the same numbers their models compute on the fly (yarn's
attention factor multiplies cos and sin, as theirs does).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn_inv_frequencies(head_dim, theta, scaling)  # type: ignore[arg-type]
    raise ValueError(f"config.json: rope_scaling type {kind!r} is not supported")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What yarn multiplies cos and sin by (1 for every other rope)."""
    s = scaling or {}
    if s.get("rope_type", s.get("type", "default")) != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return yarn_mscale(factor, float(s["mscale"])) / yarn_mscale(
            factor, float(s["mscale_all_dim"]))
    return yarn_mscale(factor)


def _yarn_inv_frequencies(dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """Blend interpolated and extrapolated frequencies over the correction range."""
    factor = float(s["factor"])
    old_len = float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation


def rotary_tables(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (cos, sin), each [max_positions, head_dim] float32."""
    inv_freq = inv_frequencies(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    factor = attention_factor(scaling)
    if factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * factor, emb.sin() * factor
