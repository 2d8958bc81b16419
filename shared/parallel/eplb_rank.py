"""A DP rank's side of dynamic EPLB, driven by the lockstep engine loop.

    every step   the ranks' all-reduce carries the newest placement version each has heard
                 of; when all have the same one, newer than what runs, every rank starts
                 applying it: one MoE layer per step (its experts' weights move between
                 the ranks), the layer's maps switching at the step boundary
    every ~1 s   the windowed expert load goes to the controller (off the hot path)

With a ``Cadence`` the rounds are counted in steps, as vLLM and vLLM-Ascend count them
(the lockstep steps in which any rank has work, dummy steps included): a round collects
its load, its report (numbered) goes out at once, the controller decides when every rank
of the group has sent that round, and a placement heard before ``hold`` steps have passed
waits for them; ``move`` more steps, and the next round starts. Without one the
controller decides on its timer.

Without a reachable controller nothing changes: the rank keeps its placement and keeps
serving. Moves are counted (bytes, seconds) for metrics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pdmesh.shared.parallel.expert_load import ExpertLoadRecorder
from pdmesh.shared.parallel.expert_parallel import ExpertParallel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cadence:
    """Step-driven EPLB rounds.

    vLLM-Ascend (Model Runner V1): ``collect`` = expert_heat_collection_interval steps of
    its phase (``recorded``), ``hold`` = algorithm_execution_interval, ``move`` = one step
    per MoE layer. vLLM (``--enable-eplb``): ``collect`` = step_interval steps, the first
    round a quarter of them (its counter starts three quarters in), no hold, no move.
    """

    collect: int
    hold: int = 0
    move: int = 0
    first: int | None = None  # the first round's collect, when it differs
    recorded: bool = False  # collect counts the load recorder's steps (its phase's)

    def __post_init__(self) -> None:
        for name in ("collect", "hold", "move"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be non-negative, got {getattr(self, name)}")



class RankEplb:
    def __init__(self, ep: ExpertParallel, recorder: ExpertLoadRecorder, client,
                 report_every_s: float = 1.0, record_path: str | None = None,
                 series: bool = False, cadence: Cadence | None = None):
        """``client``: an EplbClient (or anything with ``report`` and ``latest``);
        ``record_path``: rank 0 writes every applied placement there (vLLM-Ascend's
        ``expert_map_record_path``; ``expert_map_path`` loads it at the next start);
        ``series``: reports carry the window stage by stage (FlashLB decides on it);
        ``cadence``: step-driven rounds (see the module docstring)."""
        self.ep = ep
        self.cadence = cadence
        self.round = 0  # rounds this rank has closed (its reports carry the number)
        self.work_steps = 0  # lockstep steps in which some rank had work
        self._round_from = (0, 0)  # (work_steps, recorder.steps) at the round's start
        self._next_round_at: int | None = None  # work_steps; None while collecting
        self._hold_until = 0  # work_steps before which a new placement waits
        self.series = series
        self._series_due = 0  # the recorder's step count at which the next series is sent
        self.record_path = record_path
        self.recorder = recorder
        self.client = client
        self.report_every_s = report_every_s
        self._last_report = time.monotonic()
        self._pending: tuple[int, torch.Tensor] | None = None  # version, phy2log [L, S]
        self._next_layer = 0
        self.steps = 0
        self.move_seconds = 0.0

    def known_version(self) -> int:
        """The newest placement this rank has received (0: none); during a round's hold
        the one it runs, so that no rank starts before every rank's hold is over."""
        p = self.client.latest()
        if p is None:
            return 0
        return self.ep.version if self.work_steps < self._hold_until else p.version

    def at_step_boundary(self, newest: int, oldest: int, stepping: bool = True) -> None:
        """Called by every rank between two steps with the max and min of the ranks'
        ``known_version`` and whether they step (some rank has work): starts or
        continues applying a placement, one layer a step, and counts the rounds."""
        self.steps += 1
        closed = False
        if stepping:
            self.work_steps += 1
            closed = self._count_round()
        if self._pending is None and newest == oldest and newest > self.ep.version:
            p = self.client.latest()
            if p is not None and p.version == newest:
                expected = (len(self.ep.placements), self.ep.num_slots)
                if tuple(p.phy2log.shape) != expected:
                    log.warning("eplb: placement %d is %s, this instance needs %s; ignored",
                                p.version, list(p.phy2log.shape), list(expected))
                    self.ep.version = newest  # do not ask again
                else:
                    self._pending = (p.version, p.phy2log)
                    self._next_layer = 0
        if self._pending is not None:
            version, phy2log = self._pending
            t0 = time.perf_counter()
            self.ep.move_experts(self._next_layer, phy2log[self._next_layer])
            self.move_seconds += time.perf_counter() - t0
            self._next_layer += 1
            if self._next_layer == phy2log.shape[0]:
                self.ep.version = version
                self._pending = None
                if self.record_path and self.ep.rank == 0:
                    save_expert_map(self.record_path, phy2log, version)
                log.info("eplb: placement %d applied (%d bytes moved so far)", version,
                         self.ep.bytes_moved)
        now = time.monotonic()
        if closed or (now - self._last_report >= self.report_every_s and self.recorder.steps):
            self._last_report = now
            series = None
            if self.series and (closed or self.cadence is None
                                and self.recorder.steps >= self._series_due):
                series = self.recorder.series()  # a fresh window each time: once per window
                if series is not None:
                    self._series_due = self.recorder.steps + self.recorder.window
            self.client.report(self.recorder.load(), self.steps, self.ep.version, series,
                               self.round)

    def _count_round(self) -> bool:
        """Advance the round by one working step; True when this step closes one."""
        c = self.cadence
        if c is None:
            return False
        if self._next_round_at is not None:  # holding, then moving
            if self.work_steps < self._next_round_at:
                return False
            self._round_from = (self._next_round_at, self.recorder.steps)
            self._next_round_at = None
        target = c.first if self.round == 0 and c.first is not None else c.collect
        done = (self.recorder.steps - self._round_from[1] if c.recorded
                else self.work_steps - self._round_from[0])
        if done < target:
            return False
        self.round += 1
        self._hold_until = self.work_steps + c.hold
        self._next_round_at = self.work_steps + c.hold + c.move
        return True


def save_expert_map(path: str, phy2log: torch.Tensor, version: int) -> None:
    """The JSON ``load_expert_map`` reads, written whole or not at all."""
    import json
    import os

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"version": version, "phy2log": phy2log.tolist()}, f)
    os.replace(tmp, path)


class ControllerFinder:
    """An EplbClient for the controller the registry names, found lazily: an instance
    started before its controller picks it up at the next report."""

    def __init__(self, registry, group: str, dp_rank: int, dp_size: int, num_slots: int,
                 address: str | None = None, policy: int | None = None):
        self.registry = registry
        self.args = (group, dp_rank, dp_size)
        self.num_slots = num_slots
        self.policy = policy
        self.address = address
        self.client = None
        self._connect()

    def _connect(self) -> None:
        from pdmesh.shared.parallel.eplb_client import EplbClient

        address = self.address
        if address is None:
            try:
                found = self.registry.instances("eplb")
            except Exception as e:  # noqa: BLE001 (redis down: try at the next report)
                log.warning("eplb: registry lookup failed: %s", e)
                return
            if not found:
                return
            address = found[0].address
        self.client = EplbClient(address, *self.args, num_slots=self.num_slots,
                                 policy=self.policy)
        log.info("eplb: reporting to the controller at %s", address)

    def report(self, counts: torch.Tensor, step: int, placement_version: int,
               series: tuple[torch.Tensor, int] | None = None, round_: int = 0) -> None:
        if self.client is None:
            self._connect()
        if self.client is not None:
            self.client.report(counts, step, placement_version, series, round_)

    def latest(self):
        return self.client.latest() if self.client is not None else None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
