"""`pdmesh eplb`: the EPLB controller over gRPC.

    pdmesh eplb --host 127.0.0.1 --port 50300 [--interval-s 10 --improvement-threshold 0.05]

Port 0 picks a free one. The line ``eplb ready: {json}`` on stdout tells a launcher
where it listens. SIGTERM or SIGINT stops it: watch streams end, the registry entry goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import signal

import grpc

from pdmesh.services.eplb.controller import EplbController
from pdmesh.services.eplb.server import SERVER_OPTIONS, EplbServicer, decide_periodically
from pdmesh.shared.infra.registry import (
    Heartbeat,
    Instance,
    Registry,
    add_registry_args,
    advertised_host,
)
from pdmesh.shared.proto import eplb_pb2_grpc

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
    asyncio.run(_serve(a, controller))
    return 0


async def _serve(a: argparse.Namespace, controller: EplbController) -> None:
    loop = asyncio.get_running_loop()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    eplb_pb2_grpc.add_EplbServicer_to_server(EplbServicer(controller, loop), server)
    try:
        port = server.add_insecure_port(f"{a.host}:{a.port}")
    except RuntimeError as e:  # grpc's "failed to bind"
        raise ConnectionError(f"--port: cannot listen on {a.host}:{a.port}: {e}") from e
    await server.start()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    host = advertised_host(a.host, a.advertise_host)
    beat = Heartbeat(Registry(a.redis_url, a.registry_prefix),
                     Instance(Heartbeat.new_id("eplb"), "eplb", f"{host}:{port}"))
    timer = asyncio.create_task(decide_periodically(controller, a.interval_s, stop))
    metrics = None
    if a.metrics_port >= 0:
        from pdmesh.shared.infra.metrics import serve_metrics

        metrics = serve_metrics(controller_metrics(controller, beat.inst.id), a.host,
                                a.metrics_port)
    try:
        await asyncio.to_thread(beat.start)
        print("eplb ready: " + json.dumps({
            "grpc": f"{host}:{port}", "id": beat.inst.id,
            "metrics": f"http://{host}:{metrics}/metrics" if metrics else None}), flush=True)
        await stop.wait()
        await asyncio.to_thread(beat.stop)
    finally:
        stop.set()
        await timer
        await server.stop(grace=1)


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
