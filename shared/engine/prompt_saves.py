"""A prefill instance's puts: every prompt it computes goes into the KV pool.

    step n      the request's prompt completes; its token is sampled; its blocks are
                pinned (the put reads them after the request may have ended) and it
                comes out unfinished, with its token
    finish()    the put (the caller runs it after sending step n's tokens, so the first
                token never waits for it, or the next step runs it first); the request
                comes out again, no new token, its ``kv_keys`` set, finished if it ended
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdmesh.shared.engine.block_manager import KVBlock, KVCacheManager
from pdmesh.shared.engine.kv_connector import PoolConnector
from pdmesh.shared.engine.request import Request
from pdmesh.shared.engine.step_hooks import StepHook, StepOutput, StepRecord


@dataclass
class _Save:
    """A prompt waiting to be put into the pool: its block table per cache group, and
    the blocks pinned until the put has read them."""

    request: Request
    tables: list[list[int]]
    num_tokens: int  # the tokens they hold: the prompt (and tokens it came with)
    pinned: list[list[KVBlock]]


class PromptSaves(StepHook):
    def __init__(self, connector: PoolConnector, kv: KVCacheManager):
        self.connector = connector
        self.kv = kv
        self._pending: list[_Save] = []

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def sampled(self, step: StepRecord) -> None:
        for i in step.sample_idx:  # these computed their prompt's last token just now
            req = step.sched.requests[i]
            if not req.kv_keys:  # its prompt (and any tokens it came with) just done
                tables = [self.kv.block_ids(req, g) for g in range(len(self.kv.groups))]
                self._pending.append(_Save(req, tables, req.num_tokens, self.kv.pin(req)))
                step.held.add(id(req))

    def finish(self) -> list[StepOutput]:
        """Put the prompts the last step completed into the pool."""
        saves, self._pending = self._pending, []
        try:
            for s in saves:
                t0 = time.monotonic()
                s.request.kv_keys = self.connector.save(s.request, s.tables, s.num_tokens)
                s.request.kv_put_time = (t0, time.monotonic())
        finally:  # (also when a put raised) the blocks go back
            for s in saves:
                self.kv.unpin(s.pinned)
        return [StepOutput(s.request, [], s.request.is_finished) for s in saves]
