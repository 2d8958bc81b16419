"""SGLang's return_hidden_states: a request that asks for it ends carrying the final
(normed) hidden state of the last token the model was fed, as SGLang's OpenAI server
answers (the last of its per-forward hidden states; none when only the prompt was fed:
a request that generated one token). A step hook, like the pooler's."""

from __future__ import annotations

from typing import Any

from pdmesh.shared.engine.request import Request
from pdmesh.shared.engine.step_hooks import StepHook, StepRecord


class HiddenStates(StepHook):
    def __init__(self, runner: Any, final_hidden: Any):
        self.runner = runner  # model_runner.ModelRunner: its last_rows
        self.final_hidden = final_hidden  # rows of hidden_out -> final normed states

    def wants_hidden(self, requests: list[Request]) -> bool:
        return any(r.sampling_params.return_hidden_states for r in requests)

    def executed(self, step: StepRecord) -> None:
        rows = self.runner.last_rows
        if rows is None or not self.wants_hidden(step.sched.requests):
            return
        for i, req in enumerate(rows.requests):
            if req.sampling_params.return_hidden_states and rows.counts[i]:
                last = int(rows.row_starts[i]) + rows.counts[i] - 1
                req.last_hidden = self.final_hidden(rows.hidden[last:last + 1])[0].float()
                req.forwards += 1


def answer_hidden_states(req: Request) -> list[float]:
    """What the request's last delta carries: its last fed token's hidden state once the
    model was fed more than its prompt (a forward elsewhere, before it was handed
    here, counts: the prefill instance's)."""
    forwards = req.forwards + (1 if req.num_carried_outputs else 0)
    if req.last_hidden is None or forwards < 2:
        return []
    return req.last_hidden.cpu().tolist()
