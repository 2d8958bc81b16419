"""The engine's periodic stats line, as the servers users come from print it.

    vLLM (the default when serving; off with --disable-log-stats): every
        VLLM_LOG_STATS_INTERVAL seconds (10) that saw work (the last one showing the
        engine idle):
        "Avg prompt throughput: P tokens/s, Avg generation throughput: G tokens/s,
        Running: R reqs, Waiting: W reqs, KV cache usage: U%, Prefix cache hit rate: H%"
    SGLang (--decode-log-interval N): every N steps that decode:
        "Decode batch. #running-req: R, #token: T, token usage: U, gen throughput
        (token/s): G, #queue-req: W"

A step hook: it counts what each step computed and sampled; /metrics has the same
figures as counters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from pdmesh.shared.engine.step_hooks import StepHook, StepRecord

log = logging.getLogger("pdmesh.engine.stats")


class StatsLog(StepHook):
    def __init__(self, scheduler: Any, kv: Any, interval_s: float = 0.0,
                 decode_every: int = 0, clock: Callable[[], float] = time.monotonic):
        """``interval_s``: vLLM's line every so many seconds (0: none); ``decode_every``:
        SGLang's line every so many decoding steps (0: none)."""
        self.scheduler, self.kv = scheduler, kv
        self.interval_s, self.decode_every = interval_s, decode_every
        self.clock = clock
        self._since = clock()  # the interval's start (vLLM's line)
        self._prompt = self._generated = 0  # tokens in the interval
        self._queries = self._hits = 0  # the prefix cache's counters at its start
        self._idle_told = True  # the idle line was written (nothing ran since)
        self._decode_steps = 0
        self._decode_since = clock()
        self._decode_tokens = 0

    def updated(self, step: StepRecord) -> None:
        generated = sum(len(t) if isinstance(t, list) else 1 for t in step.tokens.values())
        self._prompt += step.prompt_tokens
        self._generated += generated
        self._idle_told = False
        if self.decode_every and step.num_decoding:
            self._decode_steps += 1
            self._decode_tokens += generated
            if self._decode_steps >= self.decode_every:
                self._decode_line()
        if self.interval_s and self.clock() - self._since >= self.interval_s:
            self.write()

    def idle(self) -> None:
        """Between steps with nothing to run: the line of the interval the work ended
        in, once due (it shows the engine idle); then none until work comes."""
        if self.interval_s and not self._idle_told \
                and self.clock() - self._since >= self.interval_s:
            self.write()
            self._idle_told = True

    def write(self) -> None:
        """vLLM's line for the interval now ending."""
        now = self.clock()
        elapsed = max(now - self._since, 1e-9)
        s = self.scheduler
        queries, hits = s.prefix_queries - self._queries, s.prefix_hits - self._hits
        log.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                 "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                 "Prefix cache hit rate: %.1f%%", self._prompt / elapsed,
                 self._generated / elapsed, len(s.running), len(s.waiting),
                 100 * self._usage(), 100 * hits / queries if queries else 0.0)
        self._since, self._prompt, self._generated = now, 0, 0
        self._queries, self._hits = s.prefix_queries, s.prefix_hits

    def _decode_line(self) -> None:
        now = self.clock()
        s = self.scheduler
        tokens = sum(r.num_tokens for r in s.running)
        log.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen "
                 "throughput (token/s): %.2f, #queue-req: %d", len(s.running), tokens,
                 self._usage(), self._decode_tokens / max(now - self._decode_since, 1e-9),
                 len(s.waiting))
        self._decode_steps = self._decode_tokens = 0
        self._decode_since = now

    def _usage(self) -> float:
        return 1 - self.kv.num_free_blocks / self.kv.num_blocks
