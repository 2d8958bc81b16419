"""The cpu backend's projections: float32 / bfloat16 ``x @ w`` through oneDNN on weights
reordered once (onednn_linear.py), and the quantized schemes through the C kernels'
AVX-512 VNNI tiles (cpu_ops.c) for a few rows, torch's integer GEMM for batches.
``CPUBackend`` (cpu.py) adds attention, norms, rotary and sampling on top."""

from __future__ import annotations

import ctypes
import dataclasses

import torch

from pdmesh.shared.kernels import cpu_ops, onednn_linear
from pdmesh.shared.kernels.base import KernelBackend
from pdmesh.shared.kernels.quant import FP8_BLOCK, QuantExperts, QuantLinear

# the C int8 / int4 kernels' output tile, and the most rows they take (they read the
# weight once per 4 rows; beyond this torch._int_mm's blocked GEMM is faster, measured)
INT8_TILE = 64
INT8_TILE_ROWS = 32


class CPUProjections(KernelBackend):
    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._ops = cpu_ops.load()  # (the attention kernels' library too)
        # the int8 / int4 kernels: AVX-512 VNNI on this CPU, and a build that has them
        self._int8 = self._ops is not None and hasattr(
            self._ops, "pdmesh_int8_static_linear") and bool(self._ops.pdmesh_int8_supported())
        # float32 / bfloat16 projections through oneDNN, weights reordered once
        self._onednn = onednn_linear.OneDNNLinears() \
            if device.type == "cpu" and onednn_linear.available() else None

    # -- float projections: oneDNN's GEMM on its blocked weights --------------------------
    def linear(self, x: torch.Tensor, w: torch.Tensor | QuantLinear,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._onednn is not None and isinstance(w, torch.Tensor) \
                and self._onednn.usable(x, w):
            return self._onednn.linear(x, w, bias)
        return super().linear(x, w, bias)

    # -- int8 projections: VNNI tiles for a few rows, torch._int_mm for batches -------
    def prepare(self, w: QuantLinear | QuantExperts) -> QuantLinear | QuantExperts:
        """The weight also in the C kernels' VNNI tiles (cpu_ops.c), which a step of up
        to INT8_TILE_ROWS rows (decode) reads instead: int8 tiles (W8A8_DYNAMIC, static
        W8A8 of one input scale) or int4, two to a byte (W4A8_DYNAMIC). The int8 weight
        stays for larger steps: the weights take 2 (W4A8: 1.5) bytes a parameter."""
        if not self._int8 or w.weight.device.type != "cpu" or w.scheme == FP8_BLOCK or (
                w.scheme == "w8a8" and (isinstance(w, QuantExperts) or len(w.bounds) != 2)):
            return w
        if isinstance(w, QuantExperts):
            tiles = [self._pack(w.weight[e], w.scheme) for e in range(w.shape[0])]
            if not tiles:
                return w
            return dataclasses.replace(
                w, packed=torch.stack([t for t, _ in tiles]),
                packed_aux=None if tiles[0][1] is None else torch.stack([c for _, c in tiles]))
        packed, colsum = self._pack(w.weight, w.scheme)
        return dataclasses.replace(w, packed=packed, packed_aux=colsum)

    def _pack(self, qweight: torch.Tensor, scheme: str
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        k, n = qweight.shape
        np_ = -(-n // INT8_TILE) * INT8_TILE
        q = qweight.contiguous()
        if scheme == "w4a8_dynamic":
            packed = torch.empty(np_ * (-(-k // 8) * 8) // 2, dtype=torch.uint8)
            self._ops.pdmesh_int4_pack(q.data_ptr(), k, n, packed.data_ptr())
            return packed, None
        packed = torch.empty(np_ * (-(-k // 4) * 4), dtype=torch.int8)
        colsum = torch.empty(np_, dtype=torch.int32)
        self._ops.pdmesh_int8_pack(q.data_ptr(), k, n, packed.data_ptr(), colsum.data_ptr())
        return packed, colsum

    def quant_linear(self, x: torch.Tensor, w: QuantLinear) -> torch.Tensor:
        m = x.shape[0]
        if w.scheme == FP8_BLOCK:  # held dequantized (a float one), or a backend's FP8
            # GEMM's own (the cuda backend's on SM90): never the int8 tiles below
            return self.linear(x, w.weight) if w.packed is None else \
                super().quant_linear(x, w)
        if w.packed is None or not 0 < m <= INT8_TILE_ROWS:
            return super().quant_linear(x, w)
        k, n = w.shape
        xf = x.float().contiguous()
        y = torch.empty((m, n), dtype=torch.float32)
        ops = self._ops
        if w.scheme == "w8a8":
            assert w.packed_aux is not None and w.deq_scale is not None \
                and w.quant_bias is not None
            work = torch.empty(m * -(-k // 4) * 4, dtype=torch.uint8)
            ops.pdmesh_int8_static_linear(
                xf.data_ptr(), m, k, n, w.packed.data_ptr(), w.packed_aux.data_ptr(),
                # (1 / scale as torch rounds it: in float32, from the double)
                ctypes.c_float(1.0 / w.input_scale[0]), ctypes.c_float(w.input_offset[0]),
                w.quant_bias.data_ptr(), w.deq_scale.data_ptr(), y.data_ptr(),
                work.data_ptr())
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        scales = torch.empty(m, dtype=torch.float32)
        qsum = torch.empty(m, dtype=torch.int32)
        offset = None if w.offset is None else w.offset.data_ptr()
        if w.scheme == "w4a8_dynamic":
            work = torch.empty(m * -(-k // 8) * 8, dtype=torch.int8)
            ops.pdmesh_int4_linear(xf.data_ptr(), m, k, n, w.packed.data_ptr(),
                                   w.scale.data_ptr(), offset, y.data_ptr(), work.data_ptr(),
                                   scales.data_ptr(), qsum.data_ptr())
        else:
            assert w.packed_aux is not None
            work = torch.empty(m * -(-k // 4) * 4, dtype=torch.uint8)
            ops.pdmesh_int8_linear(xf.data_ptr(), m, k, n, w.packed.data_ptr(),
                                   w.packed_aux.data_ptr(), w.scale.data_ptr(), offset,
                                   y.data_ptr(), work.data_ptr(), scales.data_ptr(),
                                   qsum.data_ptr())
        return y if x.dtype == torch.float32 else y.to(x.dtype)
