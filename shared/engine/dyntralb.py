"""DyntraLB: keep the data-parallel "bubble" small on a decode instance whose ranks step in
lockstep (vLLM-Ascend's ``scheduler_config.dyntra_lb_config``).

Every rank waits for the busiest one each step, so KV blocks a rank carries above the
average are time lost on every other rank. The bubble is max - mean of the ranks'
running KV blocks (ceil(tokens / block_size) per request), or (max - mean) / max when
``bubble_threshold`` < 1.

The planner is vLLM-Ascend's (``patch_dyntra_lb_core.py``, ``_balance_load``), run
identically on every rank from the same all-gathered snapshot, each rank then
taking its own moves:

    snapshot   per rank: its running requests' blocks (running order), then its
               admission candidates' (schedule order), 2 x max_num_seqs entries at most
    fill       every rank pulls waiting requests in, head first, up to max_num_seqs
    loop       (while bubble >= threshold, at most 1000 rounds) swap a running request
               for a larger waiting one on the lightest rank, and a running one for a
               smaller waiting one on the heaviest, each only if it brings that rank
               strictly closer to the mean; in a round with no swap, drop one running
               request from the heaviest rank if a step-latency model of
               20000 + 19.2 * (heaviest rank's blocks) says requests per unit of
               time go up
    result     per rank the block counts to pause ("out") and to admit ("in"), equal
               out / in pairs cancelled; a rank left with nothing to admit is frozen

A paused request leaves the running set with its KV kept (its seat is free, its blocks
are not) and waits ahead of the queue; while a plan is in force a rank admits only the
candidates it names, and candidates are only requests whose KV is here: paused ones,
prefetched ones (a planning step starts the pool reads of up to 2 x max_num_seqs -
running waiting requests, without seats), and those with nothing to read.

Planning happens between the engine steps of a busy period (a "wave"): from step
``start_step`` of each wave to ``end_step``. Steps count as vLLM's DP engine core counts
them: from 1, every step of the lockstep, and on once all ranks are idle (its dummy
steps, planned too) until the next multiple of 32, where it checks that every rank is
done and the count restarts; a request arriving before that continues the wave. In
"dynamic" mode planning starts only once a request longer than
``long_req_block_threshold`` blocks has been added on some rank, and until
``dynamic_max_step`` planning steps passed without another. vLLM-Ascend snapshots after
a step and applies the plan in the next; pdmesh snapshots just before that next step
(the same state plus the requests that arrived in between), one collective later.

(pdmesh's earlier planner, which moved every rank toward one level, measured worse on
every workload tried - docs/benchmarks.md, issue 14 - and is gone.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# vLLM's DP engine core checks that every rank is done only every this many steps
FINISH_SYNC_STEPS = 32
# vLLM-Ascend's step-latency model: fixed overhead + per KV block of the heaviest rank
STEP_FIXED = 20000
STEP_PER_BLOCK = 19.2
MAX_ROUNDS = 1000


def blocks_of(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def bubble(levels: list[int], threshold: float) -> float:
    """max - mean of the ranks' running blocks, or (max - mean) / max in ratio mode."""
    top = max(levels)
    gap = top - sum(levels) / len(levels)
    if threshold < 1:
        return gap / top if top else 0.0
    return gap


# -- vLLM-Ascend's planner -------------------------------------------------------------
@dataclass
class RankLoad:
    """One rank in the snapshot: KV blocks per running request (running order) and per
    admission candidate (schedule order)."""

    running: list[int]
    waiting: list[int] = field(default_factory=list)


@dataclass
class RankMoves:
    """What one rank does: pause a running request of each ``out`` size, admit a
    candidate of each ``in`` size; a frozen rank admits nothing."""

    out: list[int] = field(default_factory=list)
    into: list[int] = field(default_factory=list)
    freeze: bool = False


@dataclass
class _Item:
    blocks: int
    fresh: bool = False  # pulled in by the fill: dropping it means "do not admit it"


class _Rank:
    def __init__(self, index: int, load: RankLoad, slots: int):
        self.index = index
        run = load.running[:slots]
        self.running = [_Item(b) for b in run]
        self.waiting = [_Item(b) for b in load.waiting[:slots - len(run)]]
        self.total = sum(run)
        self.moves = RankMoves()

    def pull_in(self, item: _Item) -> None:
        item.fresh = True
        self.moves.into.append(item.blocks)
        self.total += item.blocks
        self.waiting.remove(item)
        self.running.append(item)

    def swap(self, out: _Item, into: _Item) -> None:
        self.moves.out.append(out.blocks)
        self.moves.into.append(into.blocks)
        self.total += into.blocks - out.blocks
        self.running.remove(out)
        self.waiting.remove(into)
        self.running.append(into)
        self.waiting.append(out)

    def drop(self, item: _Item) -> None:
        self.moves.out.append(item.blocks)
        self.total -= item.blocks
        self.running.remove(item)
        self.waiting.append(item)


def balance_load(loads: list[RankLoad], max_num_seqs: int, threshold: float,
                 max_rounds: int = MAX_ROUNDS) -> list[RankMoves]:
    """vLLM-Ascend's plan for every rank (index = DP rank) from one snapshot: upstream's
    ``_balance_load`` step for step (fill, swap rounds, drop), its two searches beside it."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
    ranks = [_Rank(i, load, 2 * max_num_seqs) for i, load in enumerate(loads)]
    for rank in ranks:  # fill free seats from the head of waiting
        while len(rank.running) < max_num_seqs and rank.waiting:
            rank.pull_in(rank.waiting[0])
    order = list(ranks)
    for _ in range(max_rounds):
        order.sort(key=lambda r: r.total, reverse=True)  # stable: ties keep their order
        if _gap(ranks, threshold) < threshold:
            break
        swapped = False
        swap = _best_swap(ranks, order[-1], up=True)
        if swap is not None:
            order[-1].swap(*swap)
            swapped = True
            if _gap(ranks, threshold) < threshold:
                break
            order.sort(key=lambda r: r.total, reverse=True)
        swap = _best_swap(ranks, order[0], up=False)
        if swap is not None:
            order[0].swap(*swap)
            swapped = True
        dropped = not swapped and _drop_for_throughput(ranks, order[0])
        if _gap(ranks, threshold) < threshold or not (swapped or dropped):
            break
    return [_settle(r.moves) for r in ranks]


def _gap(ranks: list[_Rank], threshold: float) -> float:
    return bubble([r.total for r in ranks], threshold)


def _best_swap(ranks: list[_Rank], rank: _Rank, up: bool) -> tuple[_Item, _Item] | None:
    """The swap that brings ``rank`` strictly closest to the mean, the waiting request
    larger (``up``) or smaller; ties to the first, or to undoing a fill."""
    world = len(ranks)
    mean = sum(r.total for r in ranks) / world
    best, best_dist, best_fresh = None, abs(rank.total - mean), False
    for out in rank.running:
        for into in rank.waiting:
            delta = into.blocks - out.blocks
            if (delta <= 0) if up else (delta >= 0):
                continue
            dist = abs(rank.total + delta - (mean + delta / world))
            if dist < best_dist or (dist == best_dist and out.fresh and not best_fresh):
                best, best_dist, best_fresh = (out, into), dist, out.fresh
    return best


def _drop_for_throughput(ranks: list[_Rank], heaviest: _Rank) -> bool:
    """Drop the heaviest rank's request whose absence most raises requests per modelled
    step time, if any does."""
    requests = sum(len(r.running) for r in ranks)
    if requests <= 1:
        return False
    top = heaviest.total
    second = max([r.total for r in ranks if r.index != heaviest.index] + [0])
    best, best_rate, best_fresh = None, requests / (STEP_FIXED + STEP_PER_BLOCK * top), False
    for item in heaviest.running:
        new_top = max(top - item.blocks, second)
        rate = (requests - 1) / (STEP_FIXED + STEP_PER_BLOCK * new_top)
        if rate > best_rate or (rate == best_rate and item.fresh and not best_fresh):
            best, best_rate, best_fresh = item, rate, item.fresh
    if best is None:
        return False
    heaviest.drop(best)
    return True


def _settle(moves: RankMoves) -> RankMoves:
    """Cancel equal out / in sizes (a swap undone, a fill dropped): each ``in`` takes the
    first ``out`` of its size still standing. A rank with nothing to admit is frozen."""
    standing = [True] * len(moves.out)
    into = []
    for b in moves.into:
        j = next((j for j, o in enumerate(moves.out) if standing[j] and o == b), None)
        if j is None:
            into.append(b)
        else:
            standing[j] = False
    out = [o for o, keep in zip(moves.out, standing, strict=True) if keep]
    return RankMoves(out, into, freeze=not into)


# -- one rank's side ---------------------------------------------------------------------
class DyntraLB:
    """One rank's DyntraLB: when to plan (wave steps, dynamic arming), its snapshot for
    the all-gather, and its moves applied to the scheduler. ``config``: the parsed
    ``dyntra_lb_config``."""

    def __init__(self, config, rank: int, world: int, block_size: int, max_num_seqs: int):
        self.cfg = config
        self.rank, self.world = rank, world
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.wave_steps = 0  # busy steps since all ranks were last idle
        self.armed = False  # dynamic mode: a long request was added
        self.armed_steps = 0  # planning steps since the last long request
        self._pending_long = 0  # blocks of the longest request added since last told
        self.active = False
        self.frozen_steps = 0  # planning steps this rank was frozen for admission
        self.last_bubble = 0.0
        # every plan's rank loads and moves, when a caller asks (rank 0 records them for
        # the plan-equivalence suite: `pdmesh bench dyntralb --record-loads`)
        self.record: list[dict[str, Any]] | None = None
        if config.enable_diagnostics and rank == 0:
            for key in ("enabled", "enable_diagnostics", "mode", "start_step", "end_step",
                        "bubble_threshold", "long_req_block_threshold", "dynamic_max_step"):
                log.info("[dyntra_lb] dyntra_lb_config.%s = %s", key, getattr(config, key))

    def note_added(self, num_tokens: int) -> None:
        """A request reached this rank (dynamic mode arms on one above the threshold)."""
        if self.cfg.mode != "dynamic":
            return
        blocks = blocks_of(num_tokens, self.block_size)
        if blocks > self.cfg.long_req_block_threshold:
            self._pending_long = max(self._pending_long, blocks)

    def pending_long(self) -> int:
        """Blocks of a long request added here and not yet counted (0: none)."""
        return self._pending_long

    def begin_step(self, long_added: int) -> bool:
        """Before a busy step, with the largest long request any rank added since it was
        last counted (0: none): whether this step plans. The same answer on every rank."""
        cfg = self.cfg
        self.wave_steps += 1
        steps = self.wave_steps - 1  # steps completed in this wave, as vLLM-Ascend counts
        activated = False
        if cfg.mode == "dynamic" and not self.armed:
            if long_added:
                self.armed, self.armed_steps, activated = True, 0, True
                self._say(f"Dynamic LB enabled by long request: blk_num={long_added}, "
                          f"threshold={cfg.long_req_block_threshold}, step_counter={steps}")
            self._pending_long = 0
        in_window = steps >= max(1, cfg.start_step) and (cfg.end_step < 0
                                                          or steps < cfg.end_step)
        self.active = (cfg.mode == "static" or self.armed) and in_window
        if not self.active:
            return False
        self._pending_long = 0
        if cfg.mode == "dynamic":
            if activated or long_added:
                self.armed_steps = 0
            else:
                self.armed_steps += 1
                if self.armed_steps >= cfg.dynamic_max_step:
                    self.armed = False  # this step still plans
                    self._say(f"Dynamic LB disabled after {cfg.dynamic_max_step} steps "
                              f"without long request: step_counter={steps}")
        return True

    def skip_step(self, scheduler) -> None:
        """A busy step that does not plan: no plan in force."""
        scheduler.set_lb_plan(None)

    def wave_goes_on(self) -> bool:
        """Every rank is idle: whether vLLM's DP engine core would still be stepping -
        dummy steps, counted and planned, until the count reaches a multiple of
        FINISH_SYNC_STEPS - so this moment is such a step; at the multiple the wave
        ends (``end_wave``)."""
        return self.wave_steps % FINISH_SYNC_STEPS != 0

    def end_wave(self, scheduler) -> None:
        """Every rank is idle: the step count restarts, no plan stays in force."""
        self.wave_steps = 0
        self.active = False
        scheduler.set_lb_plan(None)
        self._say("no engines running, step_counter set to 0")

    def snapshot(self, scheduler) -> list[int]:
        """This rank's entry of the all-gather: running blocks, then candidates' blocks
        (2 x max_num_seqs at most, zero padded), then how many were running. First the
        pool reads of up to 2 x max_num_seqs - running waiting requests start (only
        requests whose KV is here are candidates)."""
        bs, slots = self.block_size, 2 * self.max_num_seqs
        scheduler.collect_loads()
        scheduler.prefetch_kv(slots - len(scheduler.running))
        running = [blocks_of(r.num_tokens, bs) for r in scheduler.running][:slots]
        candidates = scheduler.lb_candidates()
        scheduler.lb_snapshot = candidates[:slots - len(running)]
        waiting = [blocks_of(r.num_tokens, bs) for r in scheduler.lb_snapshot]
        row = running + waiting
        return row + [0] * (slots - len(row)) + [len(running)]

    def plan_step(self, scheduler, gathered: list[list[int]]) -> RankMoves:
        """Every rank's snapshot in: plan, and hand this rank's moves to the scheduler."""
        slots = 2 * self.max_num_seqs
        loads = []
        for row in gathered:
            split, sizes = row[slots], row[:slots]
            end = sizes.index(0) if 0 in sizes else slots
            loads.append(RankLoad(sizes[:min(split, end)], sizes[split:end]))
        self.last_bubble = bubble([sum(load.running) for load in loads],
                                  self.cfg.bubble_threshold)
        moves = balance_load(loads, self.max_num_seqs, self.cfg.bubble_threshold)
        if self.record is not None:
            self.record.append({
                "loads": [[load.running, load.waiting] for load in loads],
                "max_num_seqs": self.max_num_seqs, "threshold": self.cfg.bubble_threshold,
                "moves": [{"out_blk": m.out, "in_blk": m.into, "freeze": m.freeze}
                          for m in moves]})
        mine = moves[self.rank]
        scheduler.set_lb_plan(mine)
        self.frozen_steps += mine.freeze
        if self.cfg.enable_diagnostics and self.rank == 0:
            log.info("[dyntra_lb] requests_by_rank (DP Workload Status):\n%s\n"
                     "[dyntra_lb] modifications:\n%s",
                     "\n".join(f" DP{i} | Run({len(load.running)}): {load.running} | "
                               f"Wait({len(load.waiting)}): {load.waiting}"
                               for i, load in enumerate(loads)),
                     "\n".join(f" DP{i} | Out: {m.out} | In: {m.into} | Freeze: {m.freeze}"
                               for i, m in enumerate(moves)))
        return mine

    def _say(self, message: str) -> None:
        """Diagnostics, from rank 0 only (as vLLM-Ascend's ``_print_rank_0``)."""
        if self.cfg.enable_diagnostics and self.rank == 0:
            log.info("[dyntra_lb] %s", message)
