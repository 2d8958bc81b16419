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

import dataclasses
import logging

import torch
import torch.nn.functional as F

from pdmesh.shared.kernels.base import AttentionMetadata, KernelBackend
from pdmesh.shared.kernels.cpu import CPUBackend
from pdmesh.shared.kernels.quant import (
    FP8_BLOCK,
    FP8_MAX,
    QuantExperts,
    QuantLinear,
    quantize_fp8_blocks,
)

log = logging.getLogger(__name__)

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_PAGE = 256  # flash attention's paged KV: page size a multiple of this


class CUDABackend(CPUBackend):
    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._flash = _flash_varlen(device)
        # DeepSeek's block FP8 GEMM: cuBLAS takes its 128 x 128 recipe on SM90 only
        self._fp8_gemm = (hasattr(F, "scaled_mm") and device.type == "cuda"
                          and torch.cuda.is_available()
                          and torch.cuda.get_device_capability(device) == (9, 0))

    # -- FP8 block GEMM (SM90): F.scaled_mm with DeepSeek's block recipes ----------------
    def prepare(self, w: QuantLinear | QuantExperts) -> QuantLinear | QuantExperts:
        """FP8-block projections on SM90 get their weight as FP8 128 x 128 blocks again
        (re-blocked on the fused matrix: exact where the checkpoint's blocks align) for
        ``F.scaled_mm``; elsewhere, and for experts, they stay dequantized."""
        if (w.scheme != FP8_BLOCK or isinstance(w, QuantExperts) or not self._fp8_gemm
                or w.shape[0] % 128 or w.shape[1] % 128):
            return super().prepare(w)
        fp8, scale = quantize_fp8_blocks(w.weight.t())  # [N, K], [N / 128, K / 128]
        kb = scale.shape[1]
        # row-major [N, K], so that its transpose is the column-major mat_b cuBLAS takes
        # (quantized from a transposed view it keeps the view's strides)
        return dataclasses.replace(w, packed=fp8.contiguous(),
                                   packed_aux=F.pad(scale, (0, -kb % 4)))

    def fp8_block_linear(self, x: torch.Tensor, w: QuantLinear) -> torch.Tensor:
        """Activations quantized to FP8 per row and 128 columns (scales column-major,
        rows padded to a multiple of 4), the weight's 128 x 128 block scales (their K
        blocks padded to a multiple of 4), as cuBLAS's block-scaled GEMM takes them
        (written from torch's F.scaled_mm recipes; unverified: no SM90 device here)."""
        m, k = x.shape
        mp = -(-m // 4) * 4
        xp = F.pad(x, (0, 0, 0, mp - m)) if mp != m else x
        groups = xp.float().view(mp, k // 128, 128)
        a_scale = groups.abs().amax(-1).clamp_min(1e-12) / FP8_MAX  # [Mp, K / 128]
        a = (groups / a_scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(mp, k)
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        y = F.scaled_mm(a, w.packed.t(), a_scale.t().contiguous().t(),
                        F.ScalingType.BlockWise1x128, w.packed_aux.t(),
                        F.ScalingType.BlockWise128x128, output_dtype=out_dtype)
        return y[:m].to(x.dtype)

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
