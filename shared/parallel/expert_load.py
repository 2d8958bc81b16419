"""Expert load: tokens routed to each (MoE layer, logical expert), per step, over a
sliding window of steps, as vLLM-Ascend's EPLB collects "expert heat".

Counting stays on the device (a scatter-add per MoE layer, no host sync); the window
is read, with one sync, only when the load is reported. ``phase`` filters which steps
count: "all", "prefill" (a step with any prompt tokens counts as prefill, as vLLM-Ascend's
``load_collection_phase`` says) or "decode".
"""

from __future__ import annotations

import torch

PHASES = ("all", "prefill", "decode")


class ExpertLoadRecorder:
    def __init__(self, num_moe_layers: int, num_experts: int, window: int,
                 phase: str = "all", device: str | torch.device = "cpu"):
        if window < 1:
            raise ValueError(f"window: must be at least 1 step (got {window})")
        if phase not in PHASES:
            raise ValueError(f"phase: must be one of {', '.join(PHASES)} (got {phase!r})")
        self.phase = phase
        self.num_experts = num_experts
        self._current = torch.zeros(num_moe_layers, num_experts, dtype=torch.int64,
                                    device=device)
        self._window = torch.zeros(window, num_moe_layers, num_experts, dtype=torch.int64,
                                   device=device)
        self._pos = 0
        self.window = window
        self.steps = 0  # steps recorded into the window so far

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """One MoE layer's routing in the current step (topk_ids [T, k], logical ids)."""
        flat = topk_ids.reshape(-1)
        self._current[layer].scatter_add_(0, flat, torch.ones_like(flat))

    def end_step(self, is_prefill: bool) -> None:
        """Close the step: into the window if its phase counts, then start afresh."""
        if self.phase == "all" or (self.phase == "prefill") == is_prefill:
            self._window[self._pos].copy_(self._current)
            self._pos = (self._pos + 1) % self._window.shape[0]
            self.steps += 1
        self._current.zero_()

    def load(self) -> torch.Tensor:
        """[num_moe_layers, num_experts] tokens over the window, on the host."""
        return self._window.sum(0).cpu()

    def series(self, max_stages: int = 64) -> tuple[torch.Tensor, int] | None:
        """The window step by step, oldest first, cut into at most ``max_stages`` stages
        of equal steps (the oldest steps that do not fill one dropped), as FlashLB
        samples it: ([stages, num_moe_layers, num_experts] on the host, steps per
        stage). None until the window is full."""
        size = self._window.shape[0]
        if self.steps < size:
            return None
        ordered = torch.roll(self._window, -self._pos, dims=0)  # oldest first
        stages = min(size, max_stages)
        width = size // stages
        kept = ordered[size - width * stages:]
        return kept.view(stages, width, *kept.shape[1:]).sum(1).cpu(), width
