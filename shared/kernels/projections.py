"""The backends' projections: float or quantized weights (``quant.QuantLinear``,
``quant.QuantExperts``), grouped expert matmuls and the routed SwiGLU experts. Default
implementations in plain torch, which :class:`base.KernelBackend` inherits and each
device backend overrides where it has a faster op (npu: ``npu_quant_matmul``,
``npu_grouped_matmul``; cpu: oneDNN).
"""

from __future__ import annotations

import torch

from pdmesh.shared.kernels.quant import DYNAMIC, FP8_BLOCK, QuantExperts, QuantLinear


class Projections:
    """A mixin of :class:`base.KernelBackend`: it uses the backend's ``name`` and
    ``silu_and_mul``."""

    def prepare(self, w: QuantLinear | QuantExperts) -> QuantLinear | QuantExperts:
        """A quantized weight as this backend computes it best (at load; default: as
        it is)."""
        return w

    def linear(self, x: torch.Tensor, w: torch.Tensor | QuantLinear,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] @ w [K, N] (+ bias) for a float weight or a quantized one
        (``quant.QuantLinear``), in x's dtype."""
        if isinstance(w, torch.Tensor):
            return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)
        out = self.quant_linear(x, w)
        return out if bias is None else out + bias

    def quant_linear(self, x: torch.Tensor, w: QuantLinear) -> torch.Tensor:
        if w.scheme == FP8_BLOCK:  # dequantized, unless the backend has an FP8 GEMM
            return torch.mm(x, w.weight) if w.packed is None else self.fp8_block_linear(x, w)
        if w.scheme in DYNAMIC:
            if w.offset is None:
                return self.int8_linear(x, w.weight, w.scale)
            q, scale = self.dynamic_quant(x)
            acc = self.int_mm(q, w.weight).float()
            acc -= q.sum(dim=-1, keepdim=True, dtype=torch.int32).float() * w.offset
            return (acc * scale[:, None] * w.scale).to(x.dtype)
        return self.static_int8_linear(x, w)

    def fp8_block_linear(self, x: torch.Tensor, w: QuantLinear) -> torch.Tensor:
        """x @ an FP8 weight the backend prepared (``prepare``); only backends that
        prepare one have it."""
        raise NotImplementedError(f"{self.name} backend: no FP8 GEMM")

    def int_mm(self, q: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
        """int8 [T, K] x int8 [K, N] -> int32 [T, N]."""
        return torch._int_mm(q, qweight)

    def static_quant(self, x: torch.Tensor, scale: float, offset: float) -> torch.Tensor:
        """Per-tensor int8 with a calibrated scale and zero point, as ``npu_quantize(x,
        1 / scale, offset, qint8)``: clamp(round(x / scale + offset), -128, 127)."""
        return torch.round(x.float() * (1.0 / scale) + offset).clamp_(-128, 127).to(
            torch.int8)

    def static_int8_linear(self, x: torch.Tensor, w: QuantLinear) -> torch.Tensor:
        """W8A8 (static): (q_x . q_w + quant_bias) * deq_scale per run of columns."""
        assert w.deq_scale is not None and w.quant_bias is not None
        outs = []
        for a, b, scale, offset in w.runs():
            q = self.static_quant(x, scale, offset)
            weight = w.weight if len(w.bounds) == 2 else w.weight[:, a:b]
            acc = self.int_mm(q, weight) + w.quant_bias[a:b]
            outs.append(acc.float() * w.deq_scale[a:b])
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out.to(x.dtype)

    # -- int8 weights and activations (W8A8_DYNAMIC) -------------------------------------
    def dynamic_quant(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Symmetric per-token int8, as ``npu_dynamic_quant`` defines it: scale =
        row_max(|x|) / 127, q = round(x / scale). x [T, K] -> (q int8 [T, K], scale [T]
        float32); x ~ q * scale."""
        xf = x.float()
        scale = xf.abs().amax(dim=-1).clamp_min(1e-12) / 127.0
        return torch.round(xf / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale

    def int8_linear(self, x: torch.Tensor, qweight: torch.Tensor,
                    weight_scale: torch.Tensor) -> torch.Tensor:
        """W8A8_DYNAMIC: x [T, K] float, qweight [K, N] int8 (input-major, per output
        channel ``weight_scale`` [N] float32) -> [T, N] in x's dtype: x quantized per token,
        int8 x int8 -> int32 (real integer compute), dequantized by both scales."""
        q, scale = self.dynamic_quant(x)
        acc = self.int_mm(q, qweight)  # [T, N] int32
        return (acc.float() * scale[:, None] * weight_scale).to(x.dtype)

    def lora_shrink_expand(self, x: torch.Tensor, a: torch.Tensor,
                           b_parts: list[torch.Tensor], bounds: list[tuple[int, int]],
                           rows: torch.Tensor, valid: torch.Tensor, out: torch.Tensor,
                           parts_of: list[int] | None = None) -> None:
        """Batched LoRA (shared/engine/lora.py): every row's adapter update added to
        ``out`` [T, N], the rows grouped by adapter: one shrink and one expand per part,
        whatever the number of adapters.

        x [T, K]; a [S, K, P * r] (slot s's A for part p in columns p * r ...);
        b_parts[p] [S, r, width of part p], written to ``out``'s columns ``bounds[p]``;
        rows [S, m]: each slot's rows of x, padded (valid [S, m, 1]: 1 on its rows, 0 on
        the padding); ``parts_of``: the parts of ``a`` the given B are (default: all, in
        order). vLLM's sgmv shrink / expand (punica's segment-gathered form) as batched
        matmuls over the slots: each row meets its own adapter's A and B only."""
        s, m = rows.shape
        flat = rows.view(-1)
        y = torch.bmm(x.index_select(0, flat).view(s, m, -1), a) * valid
        r = b_parts[0].shape[1]
        width = out.shape[1]
        parts = list(zip(parts_of or range(len(b_parts)), b_parts, bounds, strict=True))
        if len(parts) == 1 and bounds[0] == (0, width):
            z = torch.bmm(y[:, :, parts[0][0] * r:(parts[0][0] + 1) * r], parts[0][1])
        else:  # the parts side by side, as wide as ``out``, added in one scatter (one
            # into each part's columns, strided rows, is several times slower on cpu)
            z = y.new_zeros(s, m, width)
            for p, b, (lo, hi) in parts:
                z[:, :, lo:hi] = torch.bmm(y[:, :, p * r:(p + 1) * r], b)
        out.index_add_(0, flat, z.view(s * m, width))

    def grouped_matmul(
        self, x: torch.Tensor, weight: torch.Tensor | QuantExperts, group_sizes: list[int]
    ) -> torch.Tensor:
        """Rows of x sorted by group; group e is multiplied by weight[e] (float, or one
        expert of ``quant.QuantExperts``).

        x [N, K], weight [E, K, M] (input-major, as ``x @ weight[e]``),
        sum(group_sizes) == N -> [N, M].
        """
        out = x.new_empty((x.shape[0], weight.shape[2]))
        start = 0
        for e, n in enumerate(group_sizes):
            if n:
                if isinstance(weight, QuantExperts):
                    out[start : start + n] = self.quant_linear(x[start : start + n],
                                                               weight.expert(e))
                else:
                    torch.mm(x[start : start + n], weight[e], out=out[start : start + n])
                start += n
        return out

    def fused_moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        limit: float | None = None,
    ) -> torch.Tensor:
        """Routed SwiGLU experts: sum_k w_k * down_e(silu(gate_e x) * up_e x).

        x [T, H], w13 [E, H, 2I], w2 [E, I, H], topk_* [T, k] -> [T, H].
        Tokens are sorted by expert so each expert runs one matmul (no per-token loop).
        ``limit``: the swiglu clamp (``silu_and_mul``).
        """
        top_k = topk_ids.shape[1]
        num_experts = w13.shape[0]
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # [T*k]
        token_of = order // top_k  # source token of each sorted row
        group_sizes = torch.bincount(flat_ids, minlength=num_experts).tolist()
        xs = x.index_select(0, token_of)  # [T*k, H]
        h = self.silu_and_mul(self.grouped_matmul(xs, w13, group_sizes), limit)
        ys = self.grouped_matmul(h, w2, group_sizes)  # [T*k, H]
        ys = ys * topk_weights.reshape(-1)[order].unsqueeze(1).to(ys.dtype)
        out = torch.zeros_like(x)
        out.index_add_(0, token_of, ys)
        return out
