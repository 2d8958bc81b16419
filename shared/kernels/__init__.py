"""Device kernels behind one interface (:class:`KernelBackend`), one backend per device.

``resolve_device("auto")`` picks npu if torch_npu sees one, else cuda, else cpu;
``get_backend(name)`` imports only the chosen backend's module.
"""

from __future__ import annotations

import importlib

import torch

from pdmesh.shared.kernels.base import AttentionMetadata, KernelBackend

DEVICES = ("auto", "npu", "cuda", "cpu")

_BACKENDS = {
    "cpu": ("pdmesh.shared.kernels.cpu", "CPUBackend"),
    "cuda": ("pdmesh.shared.kernels.cuda", "CUDABackend"),
    "npu": ("pdmesh.shared.kernels.npu", "NPUBackend"),
}


def npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None)) and torch.npu.is_available()


def available_devices() -> list[str]:
    """Every device this process can run kernels on, cpu always included."""
    found = []
    if npu_available():
        found.append("npu")
    if torch.cuda.is_available():
        found.append("cuda")
    found.append("cpu")
    return found


def resolve_device(device: str) -> str:
    """Map ``--device`` to a concrete device name; ValueError if it is not usable here."""
    if device not in DEVICES:
        raise ValueError(f"device: must be one of {', '.join(DEVICES)}, got {device!r}")
    present = available_devices()
    if device == "auto":
        return present[0]
    if device not in present:
        raise ValueError(f"device: {device!r} requested but not available on this machine "
                         f"(available: {', '.join(present)})")
    return device


def get_backend(device: str) -> KernelBackend:
    """The kernel backend for a concrete device name (``resolve_device`` first)."""
    if device not in _BACKENDS:
        raise ValueError(f"device: no kernel backend for {device!r}")
    module, cls = _BACKENDS[device]
    backend_cls = getattr(importlib.import_module(module), cls)
    return backend_cls(torch.device(device))


__all__ = [
    "AttentionMetadata",
    "KernelBackend",
    "available_devices",
    "get_backend",
    "resolve_device",
]
