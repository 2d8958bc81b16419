"""The EPLB controller's gRPC edge (grpc.aio): decode the request, call the controller,
encode the answer; plus the timer that decides every group every interval.

A watcher is a coroutine waiting on its own queue; the controller announces each
publication from the deciding thread, and ``_announce`` hands it to the event loop,
which puts it on the queues of that group's watchers. Decisions run in a worker thread
so the event loop keeps serving reports while one is computed.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import torch

from pdmesh.services.eplb.controller import (
    Decision,
    EplbController,
    LoadSample,
    NoLoadError,
    PublishedPlacement,
)
from pdmesh.shared.proto import common_pb2, eplb_pb2, eplb_pb2_grpc

log = logging.getLogger(__name__)

# Clients ping every 10 s so that a dead controller is noticed on a silent stream;
# allow that instead of answering with GOAWAY "too_many_pings".
SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_receive_message_length", 64 << 20),
]


def sample_from_proto(r: eplb_pb2.LoadReport) -> LoadSample:
    """ValueError naming the field when the report is malformed."""
    return LoadSample.from_flat(r.group, r.dp_rank, r.dp_size, r.num_layers, r.num_experts,
                                r.num_slots, r.counts, r.step, r.placement_version,
                                r.eplb_policy_type if r.HasField("eplb_policy_type")
                                else None, r.stage_counts, r.stage_steps, r.decide_round)


def placement_to_proto(p: PublishedPlacement) -> eplb_pb2.Placement:
    return _placement(p.group, p.version, p.phy2log, p.balancedness_before,
                      p.balancedness_after)


def decision_to_proto(d: Decision) -> eplb_pb2.Placement:
    return _placement(d.group, d.version, d.phy2log, d.current, d.after)


def _placement(group: str, version: int, phy2log: torch.Tensor, before: tuple[float, ...],
               after: tuple[float, ...]) -> eplb_pb2.Placement:
    num_layers, num_slots = phy2log.shape
    return eplb_pb2.Placement(group=group, version=version, num_layers=num_layers,
                              num_slots=num_slots, phy2log=phy2log.flatten().tolist(),
                              balancedness_before=before, balancedness_after=after)


class EplbServicer(eplb_pb2_grpc.EplbServicer):
    def __init__(self, controller: EplbController, loop: asyncio.AbstractEventLoop):
        self.controller = controller
        self._loop = loop
        self._watchers: dict[str, set[asyncio.Queue[PublishedPlacement]]] = {}
        self._rounds: set[asyncio.Task] = set()  # step-driven decisions under way
        controller.add_listener(self._announce)

    def _announce(self, p: PublishedPlacement) -> None:
        """Called from the deciding thread."""
        self._loop.call_soon_threadsafe(self._fan_out, p)

    def _fan_out(self, p: PublishedPlacement) -> None:
        for queue in self._watchers.get(p.group, ()):
            queue.put_nowait(p)

    async def ReportLoad(self, request, context):  # noqa: N802 (gRPC method name)
        try:
            version = self.controller.report(sample_from_proto(request))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.controller.take_due_round(request.group):  # every rank closed the round
            task = asyncio.create_task(self._decide_round(request.group))
            self._rounds.add(task)
            task.add_done_callback(self._rounds.discard)
        return eplb_pb2.ReportAck(placement_version=version)

    async def _decide_round(self, group: str) -> None:
        try:
            await asyncio.to_thread(self.controller.decide, group)
        except ValueError as e:
            log.error("group %s: no decision for its round: %s", group, e)

    async def WatchPlacement(self, request, context):  # noqa: N802
        if not request.group:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "group: required")
        await context.send_initial_metadata(())  # the watcher knows it is connected
        queue: asyncio.Queue[PublishedPlacement] = asyncio.Queue()
        watchers = self._watchers.setdefault(request.group, set())
        watchers.add(queue)  # before reading the current one: nothing falls in between
        try:
            sent = 0
            current = self.controller.placement(request.group)
            if current is not None:
                yield placement_to_proto(current)
                sent = current.version
            while True:
                p = await queue.get()
                if p.version > sent:  # the current one may also be queued
                    yield placement_to_proto(p)
                    sent = p.version
        finally:
            watchers.discard(queue)

    async def Rebalance(self, request, context):  # noqa: N802
        if not request.group:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "group: required")
        try:
            decision = await asyncio.to_thread(self.controller.decide, request.group,
                                               request.force)
        except NoLoadError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return decision_to_proto(decision)

    async def Status(self, request, context):  # noqa: N802
        s = self.controller.status(request.group)
        return eplb_pb2.StatusResponse(
            version=s.version, balancedness=s.balancedness, reports=s.reports,
            ranks_reporting=s.ranks_reporting, decisions=s.decisions,
            proposed_balancedness=s.proposed_balancedness, **s.shape)

    async def Health(self, request, context):  # noqa: N802
        return common_pb2.HealthResponse(serving=True, role="eplb")


async def decide_periodically(controller: EplbController, interval_s: float,
                              stop: asyncio.Event) -> None:
    """Every ``interval_s``, decide every timer-driven group, until ``stop`` is set."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            await asyncio.to_thread(controller.decide_all)
