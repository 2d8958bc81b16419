"""CUDA backend: the same vectorized torch path as the CPU backend, on the GPU.

torch's scaled-dot-product attention dispatches to its flash / memory-efficient CUDA
kernels; index tensors are built on the device so a step makes no host round trips
beyond the ones the scheduler needs.

Prefill runs flash attention's varlen kernel (``torch.nn.attention.varlen.varlen_attn``)
where torch was built with it and the step fits its contract: every prompt of the step
in one call over cumulative query lengths, no padding to the longest and no mask; a
chunk after context reads its keys straight from the paged cache through the block
table. Anything outside that contract (float32, a head size flash does not take, pages
that are not a multiple of 256 tokens when context is read) runs the CPU backend's
per-sequence path, which pads nothing either.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from pdmesh.shared.kernels.base import AttentionMetadata, KernelBackend
from pdmesh.shared.kernels.cpu import CPUBackend

log = logging.getLogger(__name__)

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_PAGE = 256  # flash attention's paged KV: page size a multiple of this


class CUDABackend(CPUBackend):
    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._flash = _flash_varlen(device)

    def int_mm(self, q: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
        """``torch._int_mm`` on CUDA takes more than 16 rows and K, N multiples of 8: fewer
        rows are padded with zeros; other K, N multiply exactly in float64."""
        k, n = qweight.shape
        if k % 8 or n % 8 or not qweight.is_contiguous():
            return (q.double() @ qweight.double()).to(torch.int32)
        t = q.shape[0]
        if t <= 16:
            q = torch.cat((q, q.new_zeros((17 - t, k))))
        return torch._int_mm(q, qweight)[:t]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return super().rms_norm(x, weight, eps)

    greedy = KernelBackend.greedy  # on the device; the CPU backend's goes through numpy

    def prepare_attention(self, meta: AttentionMetadata) -> None:
        if self._flash is None or meta.is_decode:
            super().prepare_attention(meta)
            return
        # Flash varlen: int32 cumulative lengths on the device; the CPU backend's
        # per-sequence plan is built only if a layer cannot take this path.
        self._mirror.invalidate()  # as the CPU backend does before any prefill step
        seq_lens = meta.seq_lens.to(torch.int32)
        cu_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=self.device)
        cu_k[1:] = torch.cumsum(seq_lens, 0)
        meta.backend_state["flash"] = (meta.query_start_loc.to(torch.int32), cu_k, seq_lens,
                                       meta.block_tables.to(torch.int32))

    def paged_attention_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        state = meta.backend_state
        flash = state.get("flash")
        if flash is not None and self._fits_flash(q, k_cache, meta):
            cu_q, cu_k, seq_lens, block_table = flash
            if not meta.has_context:  # fresh prompts: this step's k/v are the sequences
                return self._flash(q, k, v, cu_q, cu_q, meta.max_query_len,
                                   meta.max_query_len, scale=scale, window_size=(-1, 0),
                                   enable_gqa=True)
            # Causal aligned to the bottom right: query i of a chunk after c tokens of
            # context sees keys j <= c + i, as base.py wants.
            return self._flash(q, k_cache, v_cache, cu_q, cu_k, meta.max_query_len,
                               meta.max_seq_len, scale=scale, window_size=(-1, 0),
                               enable_gqa=True, seqused_k=seq_lens, block_table=block_table)
        if flash is not None and "planned" not in state:
            super().prepare_attention(meta)
            state["planned"] = True
        return super().paged_attention_prefill(q, k, v, k_cache, v_cache, meta, scale)

    @staticmethod
    def _fits_flash(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Flash attention's contract: fp16/bf16 throughout, head size a multiple of 8 up
        to 256; reading paged context needs pages of a multiple of 256 tokens."""
        d = q.shape[-1]
        return (q.dtype in _FLASH_DTYPES and k_cache.dtype == q.dtype and d % 8 == 0
                and d <= 256 and (not meta.has_context or meta.block_size % _FLASH_PAGE == 0))


def _flash_varlen(device: torch.device):
    """``varlen_attn`` if it runs on this device (torch built with flash attention, a GPU
    it supports), else None: tried once on a small fp16 input at start-up."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        log.info("cuda: torch has no varlen_attn; prefill runs per sequence")
        return None
    try:
        x = torch.zeros(4, 2, 64, dtype=torch.float16, device=device)
        cu = torch.tensor([0, 1, 4], dtype=torch.int32, device=device)
        varlen_attn(x, x, x, cu, cu, 3, 3, window_size=(-1, 0))
    except (RuntimeError, NotImplementedError) as exc:
        log.info("cuda: flash varlen attention unavailable here (%s); prefill runs per "
                 "sequence", exc)
        return None
    return varlen_attn
