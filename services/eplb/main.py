"""`pdmesh eplb`: the EPLB controller over gRPC.

    pdmesh eplb --host 127.0.0.1 --port 50300 [--interval-s 10 --improvement-threshold 0.05]

Port 0 picks a free one. The line ``eplb ready: {json}`` on stdout tells a launcher
where it listens. SIGTERM or SIGINT stops it: watch streams end, the registry entry goes.
"""

from __future__ import annotations

import asyncio
import logging

from pdmesh.services.eplb.controller import EplbController
from pdmesh.services.eplb.server import SERVER_OPTIONS, EplbServicer, decide_periodically
from pdmesh.shared.config.serve import ServeConfig
from pdmesh.shared.proto import eplb_pb2_grpc
from pdmesh.shared.runtime.host import HostSettings, ServiceHost

log = logging.getLogger(__name__)


def run(a: ServeConfig) -> int:
    controller = EplbController(a.num_groups, a.num_nodes, a.improvement_threshold)
    settings = HostSettings("eplb", a.host, a.port, a.advertise_host, a.redis_url,
                            a.registry_prefix, a.metrics_port, metrics_names=a.metrics_names)
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
