"""The EPLB controller's logic: gather the ranks' expert load, decide, publish.

No gRPC here; ``server.py`` is the edge. Per instance group (the DP ranks of one
instance) the controller keeps each rank's latest report; the group's load is their sum.
A decision proposes a placement for that load and publishes it only when it raises the
mean balancedness by more than the threshold::

    ranks ──report──▶ latest report per rank ──sum──▶ load [L, E]
                                                        │ decide (timer or on demand)
                                                        ▼
      current placement ──balancedness──▶ current ┐
      rebalance_experts(load) ──balancedness──▶ proposed ┴─▶ proposed - current > threshold
                                                        │ or force
                                                        ▼
                                  version + 1, published to the listeners (the watchers)

A FlashLB group (eplb_policy_type 3) is judged as FlashLB aims, step by step: the
balancedness of each stage of the ranks' load series, averaged over the stages.

Before its first publication a group runs its start placement (version 0): slot ``s``
holds expert ``s % num_experts``, the identity with the redundant slots wrapping round.
Versions start above every ``placement_version`` a rank has reported, so a restarted
controller never reuses a version the ranks already run. Such a controller does not
know the placement the ranks run (they report a version above 0 that it never
published); its first decision publishes whatever the threshold says, so that the ranks
and the controller agree again, and until then it measures "current" on the start
placement.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pdmesh.shared.parallel.flash_lb import FlashLB
from pdmesh.shared.parallel.rebalance import balancedness, rebalance_experts
from pdmesh.shared.parallel.swift_balance import swap_test, swift_balance

log = logging.getLogger(__name__)

# The fields every rank of a group must agree on, in the order they are checked.
SHAPE_FIELDS = ("dp_size", "num_layers", "num_experts", "num_slots")
# vLLM-Ascend's eplb_policy_type: 0 its test swap, 1 DeepSeek's, 2 SwiftBalance, 3 FlashLB
# (on the ranks' load series); None: upstream vLLM's EPLB, DeepSeek's
POLICIES = (None, 0, 1, 2, 3)


class NoLoadError(LookupError):
    """A decision was asked for a group from which no load has been reported."""


@dataclass(frozen=True)
class LoadSample:
    """One rank's report (the proto's LoadReport, checked). ValueError naming the field
    when a value is out of range."""

    group: str
    dp_rank: int
    dp_size: int
    num_layers: int
    num_experts: int
    num_slots: int
    counts: torch.Tensor  # [num_layers, num_experts] int64, tokens per (layer, expert)
    step: int = 0
    placement_version: int = 0
    policy: int | None = None  # eplb_policy_type (None: DeepSeek's)
    stages: torch.Tensor | None = None  # [stages, num_layers, num_experts] int64 (FlashLB)
    stage_steps: int = 0  # steps summed per stage
    decide_round: int = 0  # step-driven rounds the rank has closed (0: timer-driven)

    def __post_init__(self) -> None:
        if not self.group:
            raise ValueError("group: required")
        if self.policy not in POLICIES:
            raise ValueError(f"eplb_policy_type: must be one of 0, 1, 2, 3, got {self.policy}")
        for name in SHAPE_FIELDS:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank: must be in [0, dp_size={self.dp_size}), "
                             f"got {self.dp_rank}")
        if self.num_slots < self.num_experts:
            raise ValueError(f"num_slots: must be at least num_experts ({self.num_experts}), "
                             f"got {self.num_slots}")
        if self.num_slots % self.dp_size != 0:
            raise ValueError(f"num_slots: must be a multiple of dp_size ({self.dp_size}), "
                             f"got {self.num_slots}")
        shape = (self.num_layers, self.num_experts)
        if tuple(self.counts.shape) != shape or self.counts.dtype != torch.int64:
            raise ValueError(f"counts: must be int64 [num_layers, num_experts] = {list(shape)}, "
                             f"got {self.counts.dtype} {list(self.counts.shape)}")
        if (self.counts < 0).any():
            raise ValueError("counts: must be non-negative")
        if self.step < 0:
            raise ValueError(f"step: must be non-negative, got {self.step}")
        if self.placement_version < 0:
            raise ValueError(f"placement_version: must be non-negative, "
                             f"got {self.placement_version}")
        if self.decide_round < 0:
            raise ValueError(f"decide_round: must be non-negative, got {self.decide_round}")
        if self.stages is not None:
            if self.stage_steps <= 0:
                raise ValueError(f"stage_steps: must be positive with stage_counts, "
                                 f"got {self.stage_steps}")
            if (self.stages < 0).any():
                raise ValueError("stage_counts: must be non-negative")

    @classmethod
    def from_flat(cls, group: str, dp_rank: int, dp_size: int, num_layers: int,
                  num_experts: int, num_slots: int, counts: Sequence[int], step: int = 0,
                  placement_version: int = 0, policy: int | None = None,
                  stage_counts: Sequence[int] = (), stage_steps: int = 0,
                  decide_round: int = 0) -> LoadSample:
        """``counts`` and ``stage_counts`` row-major, as the proto carries them."""
        for name, value in (("num_layers", num_layers), ("num_experts", num_experts)):
            if value <= 0:
                raise ValueError(f"{name}: must be positive, got {value}")
        if len(counts) != num_layers * num_experts:
            raise ValueError(f"counts: must hold num_layers * num_experts = "
                             f"{num_layers * num_experts} values (row-major), got {len(counts)}")
        flat = torch.tensor(counts, dtype=torch.int64)  # [L * E]
        stages = None
        if len(stage_counts):
            if len(stage_counts) % (num_layers * num_experts):
                raise ValueError(f"stage_counts: must hold a multiple of num_layers * "
                                 f"num_experts = {num_layers * num_experts} values, got "
                                 f"{len(stage_counts)}")
            stages = torch.tensor(stage_counts, dtype=torch.int64).view(
                -1, num_layers, num_experts)
        elif stage_steps:
            raise ValueError("stage_steps: set without stage_counts")
        return cls(group, dp_rank, dp_size, num_layers, num_experts, num_slots,
                   flat.view(num_layers, num_experts), step, placement_version, policy,
                   stages, stage_steps, decide_round)


@dataclass(frozen=True)
class PublishedPlacement:
    """A placement the controller published for a group."""

    group: str
    version: int
    phy2log: torch.Tensor  # [num_layers, num_slots] int64, the expert each slot holds
    balancedness_before: tuple[float, ...]  # [num_layers], the placement it replaced
    balancedness_after: tuple[float, ...]  # [num_layers], this one; same load for both


@dataclass(frozen=True)
class Decision:
    """The outcome of ``decide``. ``phy2log`` is the placement in force afterwards: the
    proposal when ``published``, else the unchanged current one."""

    group: str
    published: bool
    version: int  # the group's version afterwards
    phy2log: torch.Tensor  # [num_layers, num_slots] int64
    current: tuple[float, ...]  # [num_layers] balancedness of the placement in force before
    proposed: tuple[float, ...]  # [num_layers] balancedness of the proposal

    @property
    def after(self) -> tuple[float, ...]:
        return self.proposed if self.published else self.current


@dataclass(frozen=True)
class GroupStatus:
    version: int
    balancedness: tuple[float, ...]  # [num_layers], current placement under current load
    reports: int
    ranks_reporting: tuple[int, ...]
    shape: dict[str, int]  # SHAPE_FIELDS -> value; empty before the first report
    decisions: int
    proposed_balancedness: tuple[float, ...]  # the last decision's proposal, () before one


@dataclass
class _Group:
    shape: dict[str, int]  # SHAPE_FIELDS of the group's first report
    policy: int | None = None  # its first report's eplb_policy_type
    samples: dict[int, LoadSample] = field(default_factory=dict)  # dp_rank -> latest
    reports: int = 0
    version: int = 0  # published or reported, whichever is higher
    placement: PublishedPlacement | None = None
    decisions: int = 0
    last_proposed: tuple[float, ...] = ()
    series: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)  # FlashLB's
    flash: FlashLB = field(default_factory=FlashLB)  # its memory of the layers' ratios
    rounds: dict[int, int] = field(default_factory=dict)  # dp_rank -> rounds it closed
    decided_round: int = 0  # the last step-driven round decided

    def round_due(self) -> bool:
        """Every rank has closed a round not yet decided (step-driven groups)."""
        if len(self.rounds) < self.shape["dp_size"]:
            return False
        return min(self.rounds.values()) > self.decided_round

    def load(self) -> torch.Tensor:
        """[num_layers, num_experts] int64: the ranks' latest counts summed."""
        return torch.stack([s.counts for s in self.samples.values()]).sum(0)

    def hotness(self) -> torch.Tensor | None:
        """[stages, num_layers, num_experts]: the ranks' latest series summed (those cut
        as the newest one, the newest stages they share) plus one per step, as FlashLB
        counts; None before any rank sent one."""
        if not self.series:
            return None
        width = max(w for _, w in self.series.values())
        kept = [s for s, w in self.series.values() if w == width]
        stages = min(s.shape[0] for s in kept)
        return torch.stack([s[s.shape[0] - stages:] for s in kept]).sum(0) + width

    def knows_placement(self) -> bool:
        """False when ranks run a version this controller did not publish (a restart)."""
        return self.placement is not None or self.version == 0

    def phy2log(self) -> torch.Tensor:
        """[num_layers, num_slots]: the placement in force (the start one before any)."""
        if self.placement is not None:
            return self.placement.phy2log
        return start_placement(self.shape["num_layers"], self.shape["num_experts"],
                               self.shape["num_slots"])


def start_placement(num_layers: int, num_experts: int, num_slots: int) -> torch.Tensor:
    """[num_layers, num_slots] int64: slot s holds expert s % num_experts."""
    return (torch.arange(num_slots) % num_experts).expand(num_layers, num_slots).clone()


def replica_counts(phy2log: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[num_layers, num_experts] int64: how many slots hold each expert."""
    counts = torch.zeros(phy2log.shape[0], num_experts, dtype=torch.int64)
    return counts.scatter_add_(1, phy2log, torch.ones_like(phy2log))


def placement_balancedness(load: torch.Tensor, phy2log: torch.Tensor,
                           num_ranks: int) -> tuple[float, ...]:
    """Per layer mean/max tokens per rank for ``load`` [L, E] under ``phy2log`` [L, S]."""
    logcnt = replica_counts(phy2log, load.shape[1])
    return tuple(balancedness(load, phy2log, logcnt, num_ranks).tolist())


def stage_balancedness(stages: torch.Tensor, phy2log: torch.Tensor,
                       num_ranks: int) -> tuple[float, ...]:
    """Per layer, the mean over ``stages`` [T, L, E] of each stage's balancedness."""
    t, num_layers, num_experts = stages.shape
    logcnt = replica_counts(phy2log, num_experts).repeat(t, 1)
    per = balancedness(stages.reshape(t * num_layers, num_experts),
                       phy2log.repeat(t, 1), logcnt, num_ranks)
    return tuple(per.view(t, num_layers).mean(0).tolist())


class EplbController:
    """Thread-safe. Reports and status reads hold a lock only briefly; decisions are
    computed outside it, one at a time, and listeners hear publications in version
    order (from the deciding thread)."""

    def __init__(self, num_groups: int = 1, num_nodes: int = 1,
                 improvement_threshold: float = 0.05):
        if num_groups <= 0:
            raise ValueError(f"num_groups: must be positive, got {num_groups}")
        if num_nodes <= 0:
            raise ValueError(f"num_nodes: must be positive, got {num_nodes}")
        if not math.isfinite(improvement_threshold) or improvement_threshold < 0:
            raise ValueError("improvement_threshold: must be a non-negative number, "
                             f"got {improvement_threshold}")
        self.num_groups = num_groups
        self.num_nodes = num_nodes
        self.improvement_threshold = improvement_threshold
        self._groups: dict[str, _Group] = {}
        self._lock = threading.Lock()  # guards _groups and everything in them
        self._decide_lock = threading.Lock()  # one decision (and its announcement) at a time
        self._listeners: list[Callable[[PublishedPlacement], None]] = []

    def add_listener(self, listener: Callable[[PublishedPlacement], None]) -> None:
        """Call ``listener`` with every placement published from now on."""
        with self._decide_lock:
            self._listeners.append(listener)

    def report(self, sample: LoadSample) -> int:
        """Keep ``sample`` as its rank's latest; returns the group's current version.

        ValueError naming the field when the sample disagrees with the group's first
        report, or when the controller's --num-groups / --num-nodes cannot split it.
        """
        shape = {name: getattr(sample, name) for name in SHAPE_FIELDS}
        with self._lock:
            group = self._groups.get(sample.group)
            if group is None:
                self._check_splittable(sample)
                group = self._groups[sample.group] = _Group(shape, policy=sample.policy)
            if sample.policy != group.policy:
                raise ValueError(f"eplb_policy_type: group {sample.group!r} runs "
                                 f"{group.policy} (its first report), got {sample.policy}")
            for name in SHAPE_FIELDS:
                if shape[name] != group.shape[name]:
                    raise ValueError(f"{name}: group {sample.group!r} has {name}="
                                     f"{group.shape[name]} (its first report), got {shape[name]}")
            group.samples[sample.dp_rank] = sample
            if sample.stages is not None:
                group.series[sample.dp_rank] = (sample.stages, sample.stage_steps)
            if sample.decide_round:
                group.rounds[sample.dp_rank] = max(sample.decide_round,
                                                   group.rounds.get(sample.dp_rank, 0))
            group.reports += 1
            group.version = max(group.version, sample.placement_version)
            return group.version

    def _check_splittable(self, sample: LoadSample) -> None:
        if sample.num_experts % self.num_groups != 0:
            raise ValueError(f"num_experts: must be a multiple of the controller's "
                             f"--num-groups ({self.num_groups}), got {sample.num_experts}")
        if sample.dp_size % self.num_nodes != 0:
            raise ValueError(f"dp_size: must be a multiple of the controller's "
                             f"--num-nodes ({self.num_nodes}), got {sample.dp_size}")

    def take_due_round(self, group: str) -> bool:
        """True once per step-driven round that every rank of ``group`` has closed: the
        caller decides it then."""
        with self._lock:
            g = self._groups.get(group)
            if g is None or not g.round_due():
                return False
            g.decided_round = min(g.rounds.values())
            return True

    def groups(self) -> list[str]:
        with self._lock:
            return sorted(self._groups)

    def placement(self, group: str) -> PublishedPlacement | None:
        """The group's newest published placement, None before the first."""
        with self._lock:
            g = self._groups.get(group)
            return g.placement if g is not None else None

    def load(self, group: str) -> torch.Tensor:
        """[num_layers, num_experts] int64, the sum of the ranks' latest reports."""
        with self._lock:
            g = self._groups.get(group)
            if g is None:
                raise NoLoadError(f"group: no load reported for {group!r} yet")
            return g.load()

    def decide(self, group: str, force: bool = False) -> Decision:
        """Propose a placement for the group's load; publish it as version + 1 when it
        improves the mean balancedness by more than the threshold, when ``force``, or
        when the placement the ranks run is unknown (see the module docstring)."""
        with self._decide_lock:
            with self._lock:
                g = self._groups.get(group)
                if g is None:
                    raise NoLoadError(f"group: no load reported for {group!r} yet")
                load, current_phy2log, shape = g.load(), g.phy2log(), dict(g.shape)
                policy, hotness = g.policy, g.hotness()
                known = g.knows_placement()
            num_ranks = shape["dp_size"]
            if policy == 3:
                proposal = flash_lb(g.flash, current_phy2log, hotness, num_ranks)
            else:
                proposal = self._propose(shape, policy, load, current_phy2log)
            if policy == 3 and hotness is not None:  # judged as FlashLB aims: step by step
                current = stage_balancedness(hotness, current_phy2log, num_ranks)
                proposed = stage_balancedness(hotness, proposal, num_ranks)
            else:
                current = placement_balancedness(load, current_phy2log, num_ranks)
                proposed = placement_balancedness(load, proposal, num_ranks)
            improvement = _mean(proposed) - _mean(current)
            publish = force or not known or improvement > self.improvement_threshold
            with self._lock:
                g.decisions += 1
                g.last_proposed = proposed
                if publish:
                    g.version += 1
                    published = g.placement = PublishedPlacement(
                        group, g.version, proposal, current, proposed)
                decision = Decision(group, publish, g.version,
                                    proposal if publish else current_phy2log,
                                    current, proposed)
            if publish:
                log.info("group %s: placement %d published, balancedness %.3f -> %.3f%s",
                         group, decision.version, _mean(current), _mean(proposed),
                         " (forced)" if force else "")
                for listener in self._listeners:
                    listener(published)
            return decision

    def _propose(self, shape: dict, policy: int | None, load: torch.Tensor,
                 current: torch.Tensor) -> torch.Tensor:
        """The group's policy's placement (``phy2log``) for ``load``."""
        ranks = shape["dp_size"]
        if policy == 2:
            return swift_balance(current, load, ranks)
        if policy == 0:
            return swap_test(current, ranks) if ranks >= 4 else current
        return rebalance_experts(load, shape["num_slots"], self.num_groups, self.num_nodes,
                                 ranks).phy2log

    def decide_all(self) -> list[Decision]:
        """``decide`` every timer-driven group (the timer's work; step-driven groups
        decide when their ranks close a round); a group that fails is logged."""
        decisions = []
        with self._lock:  # (not before every rank reported: a part of the load misleads)
            timed = sorted(name for name, g in self._groups.items()
                           if not g.rounds and len(g.samples) == g.shape["dp_size"])
        for group in timed:
            try:
                decisions.append(self.decide(group))
            except ValueError as e:
                log.error("group %s: no decision: %s", group, e)
        return decisions

    def status(self, group: str) -> GroupStatus:
        """What the controller holds for ``group`` (all zero before its first report)."""
        with self._lock:
            g = self._groups.get(group)
            if g is None:
                return GroupStatus(0, (), 0, (), {}, 0, ())
            load, phy2log = g.load(), g.phy2log()
            fixed = (g.version, g.reports, tuple(sorted(g.samples)), dict(g.shape),
                     g.decisions, g.last_proposed)
        version, reports, ranks, shape, decisions, proposed = fixed
        current = placement_balancedness(load, phy2log, shape["dp_size"])
        return GroupStatus(version, current, reports, ranks, shape, decisions, proposed)


def flash_lb(policy: FlashLB, phy2log: torch.Tensor, hotness: torch.Tensor | None,
             num_ranks: int) -> torch.Tensor:
    """FlashLB's placement; the current one until a rank has sent a full window."""
    if hotness is None:
        log.info("eplb: FlashLB waits for a full window of load (expert_heat_collection_"
                 "interval steps) before it places")
        return phy2log
    table = phy2log.view(phy2log.shape[0], num_ranks, -1).numpy()
    new, _ = policy.rebalance(table, hotness.numpy())
    return torch.from_numpy(new).reshape(phy2log.shape).to(torch.int64)


def _mean(values: tuple[float, ...]) -> float:
    return sum(values) / len(values)
