"""CUDA backend: the same vectorized torch path as the CPU backend, on the GPU.

torch's scaled-dot-product attention dispatches to its flash / memory-efficient CUDA
kernels; index tensors are built on the device so a step makes no host round trips
beyond the ones the scheduler needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdmesh.shared.kernels.base import KernelBackend
from pdmesh.shared.kernels.cpu import CPUBackend


class CUDABackend(CPUBackend):
    name = "cuda"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return super().rms_norm(x, weight, eps)

    greedy = KernelBackend.greedy  # on the device; the CPU backend's goes through numpy
