"""`pdmesh eplb`: the EPLB controller over gRPC.

    pdmesh eplb --host 127.0.0.1 --port 50300 [--interval-s 10 --improvement-threshold 0.05]

Port 0 picks a free one. The line ``eplb ready: {json}`` on stdout tells a launcher
where it listens. SIGTERM or SIGINT stops it: watch streams end, the registry entry goes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math

from pdmesh.services.eplb.controller import EplbController
from pdmesh.services.eplb.server import SERVER_OPTIONS, EplbServicer, decide_periodically
from pdmesh.shared.infra.registry import add_registry_args
from pdmesh.shared.proto import eplb_pb2_grpc
from pdmesh.shared.runtime.host import HostSettings, ServiceHost

log = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free one)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="HTTP port of /metrics (0: any free one; -1: none)")
    p.add_argument("--interval-s", type=float, default=10.0,
                   help="decide every group this often (vLLM-Ascend's "
                        "algorithm_execution_interval)")
    p.add_argument("--improvement-threshold", type=float, default=0.05,
                   help="publish a new placement only when it raises the mean "
                        "balancedness (mean/max tokens per rank) by more than this")
    p.add_argument("--num-groups", type=int, default=1,
                   help="expert groups of the model (group-limited routing)")
    p.add_argument("--num-nodes", type=int, default=1,
                   help="nodes each group's ranks span (hierarchical placement when "
                        "--num-groups divides by it)")
    add_registry_args(p)


def run(a: argparse.Namespace) -> int:
    if not (math.isfinite(a.interval_s) and a.interval_s > 0):
        raise ValueError(f"--interval-s: must be a positive number, got {a.interval_s}")
    controller = EplbController(a.num_groups, a.num_nodes, a.improvement_threshold)
    settings = HostSettings("eplb", a.host, a.port, a.advertise_host, a.redis_url,
                            a.registry_prefix, a.metrics_port)
    with ServiceHost(settings) as host:
        host.aio_grpc_server(lambda server, aio: eplb_pb2_grpc.add_EplbServicer_to_server(
            EplbServicer(controller, aio), server), options=SERVER_OPTIONS)
        stop = asyncio.run_coroutine_threadsafe(_stop_event(), host.aio_loop).result(5)
        timer = asyncio.run_coroutine_threadsafe(
            decide_periodically(controller, a.interval_s, stop), host.aio_loop)
        host.at_close(lambda: (host.aio_loop.call_soon_threadsafe(stop.set),
                               timer.result(10)))
        host.serve_metrics(controller_metrics(controller, host.id))
        host.register()
        host.ready()
        host.wait()
    return 0


async def _stop_event() -> asyncio.Event:
    return asyncio.Event()


def controller_metrics(controller: EplbController, instance: str):
    """Per group: placement version, decisions, and per-layer balancedness of the
    placement in force and of the last proposal, under the current load."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def collect():
        version = GaugeMetricFamily("pdmesh_eplb_placement_version",
                                    "Newest placement published for the group.",
                                    labels=["instance", "group"])
        decisions = CounterMetricFamily("pdmesh_eplb_decisions",
                                        "Placement decisions made (published or not).",
                                        labels=["instance", "group"])
        balance = GaugeMetricFamily(
            "pdmesh_eplb_balancedness", "Mean / max tokens per rank, per MoE layer.",
            labels=["instance", "group", "layer", "placement"])
        for group in controller.groups():
            s = controller.status(group)
            version.add_metric([instance, group], s.version)
            decisions.add_metric([instance, group], s.decisions)
            for kind, values in (("current", s.balancedness),
                                 ("proposed", s.proposed_balancedness)):
                for layer, b in enumerate(values):
                    balance.add_metric([instance, group, str(layer), kind], b)
        yield from (version, decisions, balance)

    return collect
