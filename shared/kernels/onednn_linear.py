"""Float projections through oneDNN with the weight in its blocked layout (the cpu backend).

torch's ``mm`` on a float32 CPU tensor calls the BLAS it was built with (MKL in the PyPI
wheels), which on AMD CPUs takes its AVX2 code: measured on this project's AMD EPYC box
(AVX-512), one thread, ``x [M, K] @ w [K, N]`` through oneDNN with the weight reordered
once into its blocked layout ran 2.0-2.7x faster for M from 16 to 2,048 (decode batches
and prompt chunks alike) and 2.6-4.6x for M = 4, on every shape from 256 x 1,536 to
1,024 x 19k. For one float32 row the two are level on large weights and oneDNN's call
costs ~10 us more on small ones, so a float32 step of fewer than ``MIN_ROWS`` rows keeps
``mm``. bfloat16 (whose ``mm`` is oneDNN's already, on the weight as it lies): the
reordered weight 1.6-2.8x faster for 1 to 8 rows, 1.1-1.2x at 64, level from 512; every
row count takes it. vLLM's CPU backend does the same (``create_onednn_mm``, prepacked).

Each weight is reordered the first time a step meets it and kept beside the float one
(float projections take twice their bytes on a cpu engine; ``PDMESH_CPU_ONEDNN_LINEAR=0``
keeps ``mm`` and those bytes). A reordered copy is dropped with its weight and made again
if the weight changes in place.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref

import torch

log = logging.getLogger(__name__)

# float32 rows of x from which oneDNN's GEMM is taken (one row: BLAS's GEMV is level or
# faster); bfloat16 takes it from one row
MIN_ROWS = 2

# oneDNN keeps each GEMM it built, per shape - so per row count: its primitive cache and
# ideep's (1,024 entries each by default), each entry with its scratch memory. A prefill
# engine steps on prompts of every length, and its memory grew ~2.5 MB a new length with
# the tiny model (+730 MB over 320 single prompts; a soak of `pdmesh up`: +1.5 GB in 8
# minutes); with both at CACHED_GEMMS it stays flat, and steps took as long (a decode
# batch keeps its shapes: they stay cached; a prompt's GEMMs are built anew, a small part
# of its step). Read by the libraries when they first build one: set here, at import,
# before this backend builds any; the user's own values win.
CACHED_GEMMS = 32
for _name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_name, str(CACHED_GEMMS))


def available() -> bool:
    """oneDNN's packed linear works here and gives mm's products (checked once on a small
    case), and ``PDMESH_CPU_ONEDNN_LINEAR`` does not turn it off."""
    if os.environ.get("PDMESH_CPU_ONEDNN_LINEAR", "1").strip() in ("0", "false", "no",
                                                                   "off"):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, 40, generator=g)
        w = torch.randn(40, 24, generator=g)
        y = torch.ops.mkldnn._linear_pointwise(
            x, torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), None), None,
            "none", [], "")
        return bool(torch.allclose(y, x @ w, rtol=1e-4, atol=1e-4))
    except (RuntimeError, AttributeError) as e:  # a torch built without the ops
        log.debug("oneDNN packed linear unavailable: %s", e)
        return False


@functools.cache
def bfloat16_available() -> bool:
    """Whether oneDNN's packed linear takes bfloat16 here: its bf16 path needs
    avx_ne_convert or avx512bw / vl / dq, which not every x86 CPU has (checked once on a
    small case; without them bfloat16 products stay with mm)."""
    try:
        x = torch.ones(2, 32, dtype=torch.bfloat16)
        w = torch.ones(32, 16, dtype=torch.bfloat16)
        y = torch.ops.mkldnn._linear_pointwise(
            x, torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), None), None,
            "none", [], "")
        return bool(torch.allclose(y.float(), (x @ w).float()))
    except (RuntimeError, AttributeError) as e:
        log.info("oneDNN's bfloat16 linear unavailable on this cpu (%s): mm instead", e)
        return False


class OneDNNLinears:
    """The float32 / bfloat16 projection weights a cpu engine multiplies by, each also in
    oneDNN's blocked layout, keyed by the weight tensor itself."""

    def __init__(self) -> None:
        # id(weight) -> (a weak reference to it, its version when packed, the packed copy)
        self._packed: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._packed)

    def usable(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether x @ w goes through oneDNN: float32 (enough rows) or bfloat16 both, on
        the host, 2-D, and no gradient asked for (the packed op has no backward: training, e.g.
        an MTP head's distillation, keeps mm)."""
        return ((x.dtype == torch.float32 and x.shape[0] >= MIN_ROWS
                 or x.dtype == torch.bfloat16 and bfloat16_available())
                and w.dtype == x.dtype and w.dim() == 2 and x.dim() == 2
                and w.device.type == "cpu" and x.device.type == "cpu"
                and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))

    def linear(self, x: torch.Tensor, w: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] @ w [K, N] (+ bias) with w's packed copy."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._of(w), bias, "none",
                                                  [], "")

    def _of(self, w: torch.Tensor) -> torch.Tensor:
        key = id(w)
        hit = self._packed.get(key)
        if hit is not None and hit[0]() is w and hit[1] == w._version:
            return hit[2]
        packed = torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), None)

        def dropped(ref: weakref.ref, key: int = key) -> None:
            entry = self._packed.get(key)
            if entry is not None and entry[0] is ref:
                del self._packed[key]

        self._packed[key] = (weakref.ref(w, dropped), w._version, packed)
        return packed
