"""Quantized weights as the kernels take them, and their math from the definitions.

A projection weight is either a float tensor, input-major [K, N], or a ``QuantLinear``
in the same orientation; MoE experts are a float [E, K, N] or a ``QuantExperts``. The
models never look inside: ``KernelBackend.linear`` and ``grouped_matmul`` dispatch on
the type. The schemes are vLLM-Ascend's (modelslim's), computed the same way:

    w8a8_dynamic   x quantized per token (symmetric, row_max(|x|) / 127), weight per
                   output channel: y = (q_x . q_w - offset_w * sum(q_x)) * s_x * s_w
    w8a8           static: x quantized per tensor with a calibrated scale and zero point,
                   q_x = clamp(round(x / input_scale + input_offset), -128, 127);
                   y = (q_x . q_w + quant_bias) * deq_scale, where deq_scale =
                   input_scale * weight_scale and quant_bias folds the zero point (and a
                   float bias) into int32, as ``npu_quant_matmul(..., deq_scale,
                   bias=quant_bias)`` takes them
    w4a8_dynamic   as w8a8_dynamic with int4 weights in [-8, 7], held unpacked as int8
                   (the integer matmul is the int8 one)
    fp8_block      DeepSeek's block FP8, held dequantized (``weight`` in the serving
                   dtype, ``scale`` ones): y = x @ weight, or, where the backend has an
                   FP8 GEMM (cuda on SM90), FP8 128 x 128 weight blocks times activations
                   quantized per 128 columns (``prepare``)

A static projection fused from shards calibrated apart (q | k | v with three input
scales) keeps one input scale per run of columns: x is quantized once per run.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

DYNAMIC = ("w8a8_dynamic", "w4a8_dynamic")
FP8_BLOCK = "fp8_block"
FP8_MAX = 448.0  # float8_e4m3fn


@dataclass
class QuantLinear:
    scheme: str
    weight: torch.Tensor  # int8 [K, N] (w4a8_dynamic: int4 values)
    scale: torch.Tensor  # float32 [N]: the weight's per-channel scale
    offset: torch.Tensor | None = None  # float32 [N]: weight zero points (None: all 0)
    # static w8a8
    deq_scale: torch.Tensor | None = None  # float32 [N]
    quant_bias: torch.Tensor | None = None  # int32 [N]
    input_scale: tuple[float, ...] = ()  # per column run
    input_offset: tuple[float, ...] = ()
    bounds: tuple[int, ...] = ()  # the runs' column bounds: 0, ..., N
    names: tuple[str, ...] = ()  # the checkpoint weights fused into it
    # the weight again in a backend's own layout, with what it needs beside it (the cpu
    # backend's VNNI tiles and their column sums; cuda's FP8 blocks and their scales),
    # set by ``KernelBackend.prepare``
    packed: torch.Tensor | None = None
    packed_aux: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)  # type: ignore[return-value]

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def runs(self) -> list[tuple[int, int, float, float]]:
        """Static w8a8: (first column, end column, input scale, input offset) per run."""
        return [(a, b, self.input_scale[j], self.input_offset[j])
                for j, (a, b) in enumerate(zip(self.bounds, self.bounds[1:], strict=False))]


@dataclass
class QuantExperts:
    """Stacked experts [E, K, N] of one dynamic scheme: every tensor has the expert
    dimension first, so expert parallelism selects and moves them as it does floats."""

    scheme: str
    weight: torch.Tensor  # int8 [E, K, N]
    scale: torch.Tensor  # float32 [E, N]
    offset: torch.Tensor | None = None  # float32 [E, N]
    packed: torch.Tensor | None = None  # [E, ...]: as QuantLinear.packed, per expert
    packed_aux: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.weight.shape)  # type: ignore[return-value]

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def expert(self, e: int) -> QuantLinear:
        return QuantLinear(self.scheme, self.weight[e], self.scale[e],
                           None if self.offset is None else self.offset[e],
                           packed=None if self.packed is None else self.packed[e],
                           packed_aux=None if self.packed_aux is None else self.packed_aux[e])


def _tensors(w: QuantLinear | QuantExperts) -> list[torch.Tensor]:
    return [v for f in fields(w) if isinstance(v := getattr(w, f.name), torch.Tensor)]


def expert_tensors(w: torch.Tensor | QuantExperts) -> list[torch.Tensor]:
    """Every tensor of stacked experts, each [E, ...]."""
    return [w] if isinstance(w, torch.Tensor) else _tensors(w)


def with_expert_tensors(w: torch.Tensor | QuantExperts, tensors: list[torch.Tensor]
                        ) -> torch.Tensor | QuantExperts:
    """``w`` with ``expert_tensors(w)`` replaced, in the same order."""
    if isinstance(w, torch.Tensor):
        (t,) = tensors
        return t
    names = [f.name for f in fields(w) if isinstance(getattr(w, f.name), torch.Tensor)]
    return replace(w, **dict(zip(names, tensors, strict=True)))


def select_experts(w: torch.Tensor | QuantExperts, index: torch.Tensor
                   ) -> torch.Tensor | QuantExperts:
    return with_expert_tensors(w, [t.index_select(0, index.to(t.device)).contiguous()
                                   for t in expert_tensors(w)])


# -- the definitions, in float64 ---------------------------------------------------------
def dequantize(w: QuantLinear | QuantExperts) -> torch.Tensor:
    """The float weight a dynamic scheme's integers stand for (the static scheme's
    weight_scale is folded into deq_scale, so it has none of its own)."""
    q = w.weight.double()
    if w.offset is not None:
        q = q - w.offset.double().unsqueeze(-2)
    return q * w.scale.double().unsqueeze(-2)


# -- int4 ---------------------------------------------------------------------------------
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 values in [-8, 7] held as int8 [..., 2M, K] -> [..., M, K]: rows 2m (low
    nibble) and 2m + 1 (high nibble) in one byte, as modelslim packs W4A8 weights along
    the output dimension."""
    if q.shape[-2] % 2:
        raise ValueError(f"pack_int4: the output dimension ({q.shape[-2]}) must be even")
    lo, hi = q[..., 0::2, :], q[..., 1::2, :]
    return ((hi.to(torch.int16) << 4) | (lo.to(torch.int16) & 0x0F)).to(torch.uint8).view(
        torch.int8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int4``: int8 [..., M, K] -> int4 values as int8 [..., 2M, K]."""
    b = packed.to(torch.int16)
    lo = ((b & 0x0F) ^ 0x08) - 0x08  # sign-extend the low nibble
    hi = b >> 4  # arithmetic: the high nibble keeps the byte's sign
    out = torch.stack((lo, hi), dim=-2)  # [..., M, 2, K]
    return out.reshape(*packed.shape[:-2], 2 * packed.shape[-2], packed.shape[-1]).to(
        torch.int8)


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (float8_e4m3fn [N, K], float32 scale [ceil(N / bn),
    ceil(K / bk)]), one scale per block (max |w| / 448, edge blocks partial), DeepSeek's
    ``weight_scale_inv``: weight ~ fp8 * scale of its block."""
    bn, bk = block
    n, k = w.shape
    wf = w.float()
    pad = wf.new_zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    pad[:n, :k] = wf
    blocks = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (wf / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_weight(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., N, K] (checkpoint layout, out x in) -> (int8 values [..., N, K],
    float32 scale [..., N]): symmetric per output channel, int8 (127 levels) or int4
    ([-8, 7], 7 levels each side)."""
    levels = 7.0 if scheme == "w4a8_dynamic" else 127.0
    lo = -8 if scheme == "w4a8_dynamic" else -127
    wf = w.float()
    scale = wf.abs().amax(dim=-1).clamp_min(1e-12) / levels
    q = torch.round(wf / scale.unsqueeze(-1)).clamp(lo, levels).to(torch.int8)
    return q, scale
