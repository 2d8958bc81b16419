"""The C kernels of the cpu backend (cpu_ops.c) as Python sees them: the library, loaded
with each function's signature, and the argument structures its attention kernels take,
field for field as the C declares them. (The backend's use of them: cpu.py.)"""

from __future__ import annotations

import ctypes
import importlib.util
import logging

import torch

log = logging.getLogger(__name__)
CPU_OPS_MODULE = "pdmesh.shared.kernels._cpu_ops"
# cache dtypes the C paged decode kernel reads (cpu_ops.c's KV_F32 ... KV_F16)
PAGED_DECODE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float16: 3}


class PagedDecodeArgs(ctypes.Structure):
    """cpu_ops.c's paged_decode_args."""
    _fields_ = [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p),
                ("tables", ctypes.c_void_p), ("lens", ctypes.c_void_p),
                ("out", ctypes.c_void_p),
                *[(name, ctypes.c_int64) for name in ("b", "h", "kvh", "d", "v_row", "vd",
                                                       "block_size", "table_stride",
                                                       "dtype", "q_stride", "portable")],
                ("scale", ctypes.c_float)]


class PagedPrefillArgs(ctypes.Structure):
    """cpu_ops.c's paged_prefill_args."""
    _fields_ = [("base", PagedDecodeArgs), ("qstart", ctypes.c_void_p),
                ("qlens", ctypes.c_void_p)]


class SlotSource(ctypes.Structure):
    """cpu_ops.c's slot_source."""
    _fields_ = [("rows", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("n", ctypes.c_int64)]


class SinkDecodeArgs(ctypes.Structure):
    """cpu_ops.c's sink_decode_args."""
    _fields_ = [("q", ctypes.c_void_p), ("src", SlotSource * 2), ("nsrc", ctypes.c_int64),
                ("sinks", ctypes.c_void_p), ("out", ctypes.c_void_p),
                *[(name, ctypes.c_int64) for name in ("b", "h", "d", "dtype", "portable")],
                ("scale", ctypes.c_float)]


def load() -> ctypes.CDLL | None:
    """The C kernels (cpu_ops.c, built as ``CPU_OPS_MODULE``), or None if pdmesh was built
    without a C compiler (said once; the torch fallback computes the same)."""
    spec = importlib.util.find_spec(CPU_OPS_MODULE)
    if spec is None or not spec.origin:
        log.info("cpu backend: built without its C kernels (%s); hyper-connection "
                 "Sinkhorn runs as torch ops", CPU_OPS_MODULE)
        return None
    lib = ctypes.CDLL(spec.origin)
    fn = lib.pdmesh_hc_sinkhorn_f32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_float]
    fn.restype = None
    if hasattr(lib, "pdmesh_paged_decode"):
        lib.pdmesh_paged_decode.argtypes = [ctypes.POINTER(PagedDecodeArgs)]
        lib.pdmesh_paged_decode.restype = ctypes.c_int
    if hasattr(lib, "pdmesh_paged_prefill"):
        lib.pdmesh_paged_prefill.argtypes = [ctypes.POINTER(PagedPrefillArgs)]
        lib.pdmesh_paged_prefill.restype = ctypes.c_int
        lib.pdmesh_paged_prefill_supported.restype = ctypes.c_int
    if hasattr(lib, "pdmesh_sink_decode"):
        lib.pdmesh_sink_decode.argtypes = [ctypes.POINTER(SinkDecodeArgs)]
        lib.pdmesh_sink_decode.restype = ctypes.c_int
    if hasattr(lib, "pdmesh_int8_static_linear"):  # (an older build: none of them)
        ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        signatures = {
            "pdmesh_int8_pack": [ptr, i64, i64, ptr, ptr],
            "pdmesh_int8_linear": [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr],
            "pdmesh_int4_pack": [ptr, i64, i64, ptr],
            "pdmesh_int4_linear": [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr],
            "pdmesh_int8_static_linear": [ptr, i64, i64, i64, ptr, ptr, f32, f32, ptr, ptr,
                                          ptr, ptr],
        }
        for name, args in signatures.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = None
        lib.pdmesh_int8_supported.restype = ctypes.c_int
    return lib
