"""What a DP rank uses to talk to the EPLB controller (services/eplb).

    rank ── report(counts) ──▶ newest window ──▶ thread "eplb-report" ── ReportLoad ──▶
    rank ◀── latest() ◀─────── newest placement ◀── thread "eplb-watch" ◀── WatchPlacement

Neither call waits on the network: ``report`` hands the window to the sending thread
(a newer window replaces one not yet sent) and ``latest`` reads what the watching
thread stored. While the controller is unreachable both threads retry with backoff,
logging the outage once; the rank keeps serving on the placement it has and picks up
new ones when a controller answers again.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import grpc
import torch

from pdmesh.shared.infra import cluster_auth
from pdmesh.shared.proto import eplb_pb2, eplb_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """A placement the controller published for this rank's group."""

    version: int
    phy2log: torch.Tensor  # [num_layers, num_slots] int64, the logical expert of each slot
    balancedness_before: list[float]  # [num_layers], the placement this one replaces
    balancedness_after: list[float]  # [num_layers], this one (same load)


def placement_from_proto(m: eplb_pb2.Placement) -> Placement:
    """ValueError when phy2log does not hold num_layers * num_slots values."""
    if m.num_layers <= 0 or m.num_slots <= 0 or len(m.phy2log) != m.num_layers * m.num_slots:
        raise ValueError(f"phy2log: {len(m.phy2log)} values for num_layers={m.num_layers} "
                         f"x num_slots={m.num_slots}")
    phy2log = torch.tensor(m.phy2log, dtype=torch.int64).view(m.num_layers, m.num_slots)
    return Placement(m.version, phy2log, list(m.balancedness_before),
                     list(m.balancedness_after))


class EplbClient:
    """One rank's link to the controller at ``address`` ("host:port").

    ``num_slots`` is the physical expert slots per layer (experts + redundant ones);
    None means no redundant experts (as many slots as ``counts`` has experts).
    Unreachable controllers are retried every ``min_backoff_s``, doubling up to
    ``max_backoff_s``.
    """

    def __init__(self, address: str, group: str, dp_rank: int, dp_size: int, *,
                 num_slots: int | None = None, policy: int | None = None,
                 rpc_timeout_s: float = 2.0,
                 min_backoff_s: float = 0.1, max_backoff_s: float = 5.0):
        if not group:
            raise ValueError("group: required")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank: must be in [0, dp_size={dp_size}), got {dp_rank}")
        self.address = address
        self.group = group
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.num_slots = num_slots
        self.policy = policy  # eplb_config.eplb_policy_type (None: DeepSeek's)
        self._rpc_timeout_s = rpc_timeout_s
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._channel = cluster_auth.channel(address, options=[
            # a dead controller on a silent stream is noticed within ~15 s
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # reconnect at our pace, not grpc's default (up to two minutes)
            ("grpc.initial_reconnect_backoff_ms", int(min_backoff_s * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(min_backoff_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(max_backoff_s * 1000)),
        ])
        self._stub = eplb_pb2_grpc.EplbStub(self._channel)
        self._closed = threading.Event()
        self._lock = threading.Condition()  # guards everything below
        # (counts, step, version, (stages, steps per stage) or None, round)
        self._pending: tuple[torch.Tensor, int, int, tuple | None, int] | None = None
        self._latest: Placement | None = None
        self._watch_call: grpc.Future | None = None
        self._failing: set[str] = set()  # "report" / "watch" while the controller is down
        self._rejected = ""  # the last INVALID_ARGUMENT logged
        self._threads = [threading.Thread(target=self._send_loop, name="eplb-report",
                                          daemon=True),
                         threading.Thread(target=self._watch_loop, name="eplb-watch",
                                          daemon=True)]
        for t in self._threads:
            t.start()

    def report(self, counts: torch.Tensor, step: int, placement_version: int,
               series: tuple[torch.Tensor, int] | None = None, round_: int = 0) -> None:
        """Queue this rank's window ``counts`` [num_layers, num_experts] (tokens per
        layer and logical expert) for sending, with the window in ``series`` stages
        ([stages, num_layers, num_experts], steps per stage) when given and the number
        of step-driven rounds the rank has closed; returns at once. A report that
        replaces one not yet sent keeps that one's series when it has none.

        ValueError when ``counts`` is not 2-D or ``series`` not 3-D of the same layers
        and experts; the controller's own rejections are logged.
        """
        if counts.dim() != 2:
            raise ValueError(f"counts: must be [num_layers, num_experts], "
                             f"got shape {list(counts.shape)}")
        counts = counts.detach().to("cpu", torch.int64, copy=True)  # [L, E]
        if series is not None:
            stages, width = series
            if stages.dim() != 3 or tuple(stages.shape[1:]) != tuple(counts.shape):
                raise ValueError(f"series: must be [stages, {counts.shape[0]}, "
                                 f"{counts.shape[1]}], got {list(stages.shape)}")
            series = (stages.detach().to("cpu", torch.int64, copy=True), width)
        with self._lock:
            if series is None and self._pending is not None:
                series = self._pending[3]
            self._pending = (counts, step, placement_version, series, round_)
            self._lock.notify_all()

    def latest(self) -> Placement | None:
        """The newest placement received, None before the first."""
        with self._lock:
            return self._latest

    def wait_for(self, min_version: int, timeout_s: float) -> Placement | None:
        """Block until a placement of at least ``min_version`` arrives (or ``timeout_s``
        passes); returns the newest one then, which may be older on a timeout."""
        with self._lock:
            self._lock.wait_for(lambda: self._latest is not None
                                and self._latest.version >= min_version, timeout_s)
            return self._latest

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._lock.notify_all()
            if self._watch_call is not None:
                self._watch_call.cancel()
        for t in self._threads:
            t.join(5)
        self._channel.close()

    def __enter__(self) -> EplbClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _to_proto(self, counts: torch.Tensor, step: int, placement_version: int,
                  series: tuple[torch.Tensor, int] | None,
                  round_: int) -> eplb_pb2.LoadReport:
        num_layers, num_experts = counts.shape
        report = eplb_pb2.LoadReport(
            group=self.group, dp_rank=self.dp_rank, dp_size=self.dp_size,
            num_layers=num_layers, num_experts=num_experts,
            num_slots=self.num_slots if self.num_slots is not None else num_experts,
            counts=counts.flatten().tolist(), step=step, placement_version=placement_version,
            eplb_policy_type=self.policy, decide_round=round_)
        if series is not None:
            report.stage_counts.extend(series[0].flatten().tolist())
            report.stage_steps = series[1]
        return report

    def _send_loop(self) -> None:
        backoff = self._min_backoff_s
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._pending is not None or self._closed.is_set())
                if self._closed.is_set():
                    return
                window, self._pending = self._pending, None
            try:
                self._stub.ReportLoad(self._to_proto(*window), timeout=self._rpc_timeout_s)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    self._log_rejection(e.details())
                    continue
                self._set_failing("report", e)
                with self._lock:
                    if self._pending is None:  # retry it unless a newer window came
                        self._pending = window
                self._closed.wait(backoff)
                backoff = min(2 * backoff, self._max_backoff_s)
                continue
            self._set_ok("report")
            backoff = self._min_backoff_s

    def _watch_loop(self) -> None:
        backoff = self._min_backoff_s
        while not self._closed.is_set():
            with self._lock:
                if self._closed.is_set():
                    return
                call = self._watch_call = self._stub.WatchPlacement(
                    eplb_pb2.WatchRequest(group=self.group))
            try:
                call.initial_metadata()  # returns when the watch is accepted, or has failed
                if not call.done():
                    self._set_ok("watch")
                    backoff = self._min_backoff_s
                for message in call:
                    self._receive(message)
            except grpc.RpcError as e:
                if self._closed.is_set():
                    return
                self._set_failing("watch", e)
            self._closed.wait(backoff)  # the stream ended: the controller went away
            backoff = min(2 * backoff, self._max_backoff_s)

    def _receive(self, message: eplb_pb2.Placement) -> None:
        try:
            placement = placement_from_proto(message)
        except ValueError as e:
            log.error("eplb %s: ignoring a malformed placement %d: %s", self.address,
                      message.version, e)
            return
        with self._lock:
            self._latest = placement
            self._lock.notify_all()

    def _set_failing(self, what: str, e: grpc.RpcError) -> None:
        with self._lock:
            first = what not in self._failing
            self._failing.add(what)
        if first:
            log.warning("eplb controller %s unreachable (%s: %s %s); rank %d of %s keeps "
                        "its placement and retries", self.address, what, e.code().name,
                        e.details(), self.dp_rank, self.group)

    def _set_ok(self, what: str) -> None:
        with self._lock:
            recovered = what in self._failing
            self._failing.discard(what)
        if recovered:
            log.info("eplb controller %s reachable again (%s)", self.address, what)

    def _log_rejection(self, details: str) -> None:
        if details != self._rejected:
            self._rejected = details
            log.error("eplb controller %s rejected rank %d's report: %s", self.address,
                      self.dp_rank, details)
