"""An instance's puts into the KV pool: a prefill instance's of every prompt it computes,
a decode instance's (vLLM-Ascend's consumer_is_to_put) of every request it finishes.

    step n      a prompt completes; its token is sampled; its blocks are pinned (the put
                reads them after the request may have ended) and it comes out
                unfinished, with its token
                (decode) a request ends: its blocks are pinned as they are given back
    finish()    the put (the caller runs it after sending step n's tokens, so the first
                token never waits for it, or the next step runs it first); a prompt's
                request comes out again, no new token, its ``kv_keys`` set, finished if
                it ended; an ended request's put is all there is (it came out already)

An ended request leaves its prompt and its answer but the last token (whose KV no step
computed): the next turn of a conversation, whose prompt is this history, finds it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdmesh.shared.engine.block_manager import KVBlock, KVCacheManager
from pdmesh.shared.engine.kv_connector import PoolConnector
from pdmesh.shared.engine.request import Request, RequestStatus
from pdmesh.shared.engine.step_hooks import StepHook, StepOutput, StepRecord


@dataclass
class _Save:
    """A prompt waiting to be put into the pool: its block table per cache group, and
    the blocks pinned until the put has read them."""

    request: Request
    tables: list[list[int]]
    num_tokens: int  # the tokens they hold: the prompt (and tokens it came with)
    pinned: list[list[KVBlock]]
    report: bool = True  # the request comes out again once put (a prompt's)


# how a request ended, for its KV to be worth keeping (not aborted, not failed)
KEPT_ENDINGS = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class PromptSaves(StepHook):
    def __init__(self, connector: PoolConnector, kv: KVCacheManager, prompts: bool = True,
                 finished: bool = False):
        """``prompts``: put each computed prompt (a prefill instance); ``finished``: put
        each request that ends (a decode instance under consumer_is_to_put)."""
        self.connector = connector
        self.kv = kv
        self.prompts = prompts
        self._pending: list[_Save] = []
        if finished:
            kv.on_free = self._ended

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def sampled(self, step: StepRecord) -> None:
        if not self.prompts:
            return
        for i in step.sample_idx:  # these computed their prompt's last token just now
            req = step.sched.requests[i]
            if not req.kv_keys:  # its prompt (and any tokens it came with) just done
                tables = [self.kv.block_ids(req, g) for g in range(len(self.kv.groups))]
                self._pending.append(_Save(req, tables, req.num_tokens, self.kv.pin(req)))
                step.held.add(id(req))

    def _ended(self, req: Request) -> None:
        """A request gives its blocks back: if it ended as asked, they are pinned for
        its put (of the tokens whose KV was computed: all but the last)."""
        if req.status not in KEPT_ENDINGS or req.num_tokens < 2:
            return
        tables = [list(self.kv.block_ids(req, g)) for g in range(len(self.kv.groups))]
        self._pending.append(_Save(req, tables, req.num_tokens - 1, self.kv.pin(req),
                                   report=False))

    def finish(self) -> list[StepOutput]:
        """Put the prompts the last step completed, and the requests that ended, into
        the pool."""
        saves, self._pending = self._pending, []
        try:
            for s in saves:
                t0 = time.monotonic()
                s.request.kv_keys = self.connector.save(s.request, s.tables, s.num_tokens)
                s.request.kv_put_time = (t0, time.monotonic())
        finally:  # (also when a put raised) the blocks go back
            for s in saves:
                self.kv.unpin(s.pinned)
        return [StepOutput(s.request, [], s.request.is_finished) for s in saves if s.report]
