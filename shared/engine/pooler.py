"""The pooling runner's step hook: a pooling request's prompt rows, pooled as they are
computed (``pooling.Pooling`` says how)."""

from __future__ import annotations

from typing import Any

import torch

from pdmesh.shared.engine.pooling import Pooling
from pdmesh.shared.engine.request import Request
from pdmesh.shared.engine.step_hooks import StepHook, StepRecord


def pool_rows(rows: torch.Tensor, pooling: Pooling) -> list[float]:
    """[n, hidden] final hidden rows (already picked: the last, the first, or the sum's
    one row with n = 1 after dividing) -> the embedding."""
    vec = rows.float().reshape(-1)
    if pooling.dimensions is not None:
        vec = vec[:pooling.dimensions]
    if pooling.normalize:
        vec = torch.nn.functional.normalize(vec, dim=-1)
    return vec.cpu().tolist()


class Pooler(StepHook):
    """Pools each pooling request's rows as its prompt is computed: a running sum for
    MEAN (a chunk at a time; rows computed before a preemption are not counted twice),
    the row wanted for LAST and CLS. When the prompt's last row is in, the request's
    ``embedding`` is set; the sampler's token after it is dropped by the edge."""

    def __init__(self, runner: Any, final_hidden: Any):
        self.runner = runner  # model_runner.ModelRunner: its last_rows
        self.final_hidden = final_hidden  # rows of hidden_out -> final normed states

    def wants_hidden(self, requests: list[Request]) -> bool:
        return any(r.pooling is not None and r.embedding is None for r in requests)

    def executed(self, step: StepRecord) -> None:
        rows = self.runner.last_rows
        if rows is None or not self.wants_hidden(step.sched.requests):
            return
        for i, req in enumerate(rows.requests):
            if req.pooling is None or req.embedding is not None:
                continue
            start, count = rows.starts[i], rows.counts[i]
            at = int(rows.row_starts[i])
            n_prompt = req.num_prompt_tokens
            kind = req.pooling.type
            if kind == "MEAN":
                lo = max(start, req.pooled_upto)
                hi = min(start + count, n_prompt)
                if hi > lo:
                    part = self.final_hidden(rows.hidden[at + lo - start:at + hi - start])
                    total = part.float().sum(0)
                    req.pooled = total if req.pooled is None else req.pooled + total
                    req.pooled_upto = hi
            elif kind == "CLS" and start == 0 and count:
                req.pooled = self.final_hidden(rows.hidden[at:at + 1]).float()[0]
            if start + count < n_prompt:
                continue
            if kind == "LAST":
                last = at + n_prompt - 1 - start
                req.pooled = self.final_hidden(rows.hidden[last:last + 1]).float()[0]
            elif kind == "MEAN":
                req.pooled = req.pooled / n_prompt
            req.embedding = pool_rows(req.pooled, req.pooling)
            req.pooled = None
