"""DyntraLB: keep the data-parallel "bubble" small on a decode instance whose ranks step in
lockstep (vLLM-Ascend's ``scheduler_config.dyntra_lb_config``).

Every rank waits for the busiest one each step, so time spent on a rank's KV blocks above
the average is lost on every other rank: the bubble, max - mean of the ranks' active KV
blocks (ceil(tokens / block_size) per running request), or (max - mean) / max when
``bubble_threshold`` < 1. Each step the ranks share their active blocks and the size of
their smallest running request (inside the lockstep all-reduce, so no extra
collective) and each rank moves toward one level

    level = max(mean + threshold / 2,       (blocks; for a ratio: + threshold / 2 * max)
                the largest "smallest running request" of any rank: no rank can go
                lower than the one request it keeps)

    above it   keep running requests, largest first, while they fit under the level, and
               pause the rest (their KV stays); at least the smallest keeps running;
               admit nothing
    below it   resume paused requests first (oldest first) while they fit, then admit
               waiting requests up to the level; a rank with nothing to resume or admit
               simply stays frozen for admission
    off        (outside [start_step, end_step), or in "dynamic" mode while no long
               request, >= long_req_block_threshold blocks, was seen in the last
               dynamic_max_step steps): every paused request resumes, admission is free

No KV ever moves between ranks and no request is dropped: a paused request keeps its
blocks and its place, and is resumed before anything new is admitted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


def blocks_of(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def bubble(levels: list[int], threshold: float) -> float:
    """max - mean of the ranks' active blocks, or (max - mean) / max in ratio mode."""
    top = max(levels)
    gap = top - sum(levels) / len(levels)
    if threshold < 1:
        return gap / top if top else 0.0
    return gap


def target_level(levels: list[int], floors: list[int], threshold: float) -> float:
    mean = sum(levels) / len(levels)
    slack = threshold / 2 * max(levels) if threshold < 1 else threshold / 2
    return max(mean + slack, max(floors, default=0))


@dataclass
class RankState:
    """One rank's requests, as (request id, KV blocks) pairs, in queue order."""

    running: list[tuple[str, int]]  # active (not paused)
    paused: list[tuple[str, int]] = field(default_factory=list)  # oldest first
    waiting: list[tuple[str, int]] = field(default_factory=list)  # admission order

    @property
    def active_blocks(self) -> int:
        return sum(b for _, b in self.running)

    @property
    def floor(self) -> int:
        """The least this rank can run: its smallest running request (0 if none)."""
        return min((b for _, b in self.running), default=0)


@dataclass
class RankPlan:
    pause: list[str] = field(default_factory=list)
    resume: list[str] = field(default_factory=list)
    admit_blocks: int | None = None  # blocks this rank may admit this step (None: any)


def plan_rank(state: RankState, level: float) -> RankPlan:
    """This rank's moves toward ``level`` (the same level on every rank)."""
    load = state.active_blocks
    out = RankPlan(admit_blocks=0)
    if load > level:
        kept = 0
        smallest = min(state.running, key=lambda rb: rb[1])
        for rid, b in sorted(state.running, key=lambda rb: -rb[1]):
            if kept + b <= level:
                kept += b
            elif (rid, b) != smallest or kept:
                out.pause.append(rid)
        if len(out.pause) == len(state.running):  # keep one running: the smallest
            out.pause.remove(smallest[0])
        return out
    for rid, b in state.paused:
        if load + b > level:
            break
        out.resume.append(rid)
        load += b
    out.admit_blocks = max(0, int(level - load))
    return out


def plan(states: list[RankState], threshold: float) -> list[RankPlan]:
    """Every rank's moves for one step (what the runtime does, rank by rank): nothing
    while the bubble is within the threshold (paused requests resume), else each rank
    toward the common level."""
    levels = [s.active_blocks for s in states]
    if not any(levels) or bubble(levels, threshold) <= threshold:
        return [RankPlan(resume=[rid for rid, _ in s.paused]) for s in states]
    level = target_level(levels, [s.floor for s in states], threshold)
    return [plan_rank(s, level) for s in states]


class DyntraLB:
    """One rank's side: decides when balancing is on and applies its rank's plan to the
    scheduler. ``config``: the parsed ``dyntra_lb_config``."""

    def __init__(self, config, rank: int, world: int, block_size: int):
        self.cfg = config
        self.rank, self.world = rank, world
        self.block_size = block_size
        self.step = 0
        self._long_until = -1  # dynamic mode: balancing stays on until this step
        self.pauses = 0
        self.resumes = 0
        self.frozen_steps = 0  # steps this rank admitted nothing new (its cap was 0)
        self.last_bubble = 0.0
        self.active = False

    # what this rank contributes to the lockstep all-reduce
    def local_summary(self, scheduler) -> tuple[int, int, int]:
        """(active KV blocks, 1 if a long request is running or waiting here, blocks of
        the smallest active request)."""
        bs = self.block_size
        sizes = [blocks_of(r.num_tokens, bs) for r in scheduler.running
                 if not scheduler.is_paused(r)]
        longest = max((blocks_of(r.num_tokens, bs)
                       for r in (*scheduler.running, *scheduler.waiting)), default=0)
        return (sum(sizes), int(longest >= self.cfg.long_req_block_threshold),
                min(sizes, default=0))

    def on_step(self, scheduler, levels: list[int], long_seen: bool,
                floors: list[int] | None = None) -> None:
        """Between two steps, with every rank's active blocks (and smallest running
        request): pause / resume / limit admission."""
        cfg = self.cfg
        self.step += 1
        in_window = self.step >= cfg.start_step and (cfg.end_step < 0 or
                                                      self.step < cfg.end_step)
        if cfg.mode == "dynamic" and long_seen:
            self._long_until = self.step + cfg.dynamic_max_step
        active = in_window and (cfg.mode == "static" or self.step < self._long_until)
        self.active = active
        self.last_bubble = bubble(levels, cfg.bubble_threshold) if any(levels) else 0.0
        if not active or self.last_bubble <= cfg.bubble_threshold:
            resumed = scheduler.resume_all()
            self.resumes += resumed
            scheduler.admit_blocks = None
            return
        bs = self.block_size
        state = RankState(
            running=[(r.request_id, blocks_of(r.num_tokens, bs)) for r in scheduler.running
                     if not scheduler.is_paused(r)],
            paused=[(r.request_id, blocks_of(r.num_tokens, bs)) for r in scheduler.paused])
        level = target_level(levels, floors or [0], cfg.bubble_threshold)
        rank_plan = plan_rank(state, level)
        for rid in rank_plan.pause:
            scheduler.pause(rid)
        for rid in rank_plan.resume:
            scheduler.resume(rid)
        scheduler.admit_blocks = rank_plan.admit_blocks
        self.frozen_steps += rank_plan.admit_blocks == 0
        self.pauses += len(rank_plan.pause)
        self.resumes += len(rank_plan.resume)
        if cfg.enable_diagnostics:
            log.info("dyntralb rank %d step %d: bubble %.1f levels %s pause %d resume %d "
                     "admit<=%s", self.rank, self.step, self.last_bubble, levels,
                     len(rank_plan.pause), len(rank_plan.resume), rank_plan.admit_blocks)


def apply(states: list[RankState], plans: list[RankPlan]) -> list[RankState]:
    """The states after each rank carried out its plan and admitted waiting requests in
    order while they fit its admission cap (what the scheduler does)."""
    out = []
    for s, p in zip(states, plans, strict=True):
        running = [rb for rb in s.running if rb[0] not in p.pause]
        paused = [rb for rb in s.paused if rb[0] not in p.resume]
        paused += [rb for rb in s.running if rb[0] in p.pause]
        running += [rb for rb in s.paused if rb[0] in p.resume]
        waiting = list(s.waiting)
        cap = p.admit_blocks
        while waiting and (cap is None or waiting[0][1] <= cap):
            rb = waiting.pop(0)
            running.append(rb)
            if cap is not None:
                cap -= rb[1]
        out.append(RankState(running, paused, waiting))
    return out
