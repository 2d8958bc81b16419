"""Prometheus ``/metrics`` for the gRPC services, on a small HTTP port of their own.

Values are read when Prometheus scrapes (a Collector), so serving pays nothing for
them. Names follow vLLM's, prefixed ``pdmesh_``, with units and ``_total`` as
Prometheus expects; every sample carries model_name, instance, role and dp_rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger(__name__)

LABELS = ("model_name", "instance", "role", "dp_rank")


def serve_metrics(collect: Callable[[], Iterator[Metric]], host: str, port: int) -> int:
    """Serve ``collect``'s metrics at http://host:port/metrics from a daemon thread;
    returns the port (0 picks a free one)."""

    class _Collector:
        def collect(self) -> Iterator[Metric]:
            try:
                yield from collect()
            except Exception:  # noqa: BLE001 (a scrape must not take the service down)
                log.exception("metrics collection failed")

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())  # type: ignore[arg-type]
    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)


def gauge(name: str, doc: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=list(labels))
    g.add_metric(list(labels.values()), value)
    return g


def counter(name: str, doc: str, labels: dict[str, str], value: float) -> CounterMetricFamily:
    """``name`` without ``_total`` (the exposition adds it)."""
    c = CounterMetricFamily(name, doc, labels=list(labels))
    c.add_metric(list(labels.values()), value)
    return c


def worker_metrics(loop, labels: dict[str, str], eplb=None) -> Callable[[], Iterator[Metric]]:
    """What an engine instance (prefill, decode, mixed; one DP rank) exports."""

    def collect() -> Iterator[Metric]:
        ld = loop.load()
        yield gauge("pdmesh_num_requests_running", "Requests in the running batch.", labels,
                    ld.running)
        yield gauge("pdmesh_num_requests_waiting", "Requests waiting to be scheduled.",
                    labels, ld.waiting)
        used = 1.0 - ld.free_kv_blocks / ld.total_kv_blocks if ld.total_kv_blocks else 0.0
        yield gauge("pdmesh_kv_cache_usage_perc", "KV-cache usage, 1 means full.", labels,
                    used)
        sched = loop.engine.scheduler
        yield counter("pdmesh_num_preemptions", "Requests that gave up their KV blocks "
                      "(recomputed here, or handed back).", labels, sched.preemptions)
        yield counter("pdmesh_requests_recomputed", "Requests the recompute scheduler "
                      "handed back to be re-prefilled elsewhere.", labels, sched.recomputed)
        lb = loop.engine.dyntralb
        if lb is not None:
            yield gauge("pdmesh_dp_bubble_blocks", "DP bubble at the last step: max - mean "
                        "active KV blocks over the ranks (a ratio below 1 in ratio mode).",
                        labels, lb.last_bubble)
            yield gauge("pdmesh_dyntralb_active", "1 while DyntraLB balances.", labels,
                        int(lb.active))
            yield counter("pdmesh_dyntralb_pauses", "Running requests DyntraLB paused.",
                          labels, lb.pauses)
            yield counter("pdmesh_dyntralb_resumes", "Paused requests DyntraLB resumed.",
                          labels, lb.resumes)
        ep = loop.engine.ep
        if ep is not None:
            yield gauge("pdmesh_eplb_placement_version", "Expert placement this rank runs.",
                        labels, ep.version)
            yield counter("pdmesh_eplb_expert_weight_bytes_moved",
                          "Expert weight bytes this rank received in placement changes.",
                          labels, ep.bytes_moved)
            if eplb is not None:
                yield counter("pdmesh_eplb_move_seconds",
                              "Time this rank spent moving expert weights.", labels,
                              eplb.move_seconds)

    return collect
