"""Prometheus ``/metrics`` for the gRPC services, on a small HTTP port of their own.

Values are read when Prometheus scrapes (a Collector), so serving pays nothing for
them. Names follow vLLM's, prefixed ``pdmesh_``, with units and ``_total`` as
Prometheus expects; every sample carries model_name, instance, role and dp_rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

log = logging.getLogger(__name__)

# no "<counter>_created" series next to every counter and histogram (as vLLM does)
prometheus_client.disable_created_metrics()

LABELS = ("model_name", "instance", "role", "dp_rank")

# Every metric family a pdmesh service exports, as scraped (counters with ``_total``;
# histograms also expose ``_bucket``/``_sum``/``_count``). Dashboards and alerts may use
# exactly these; tests scrape the services and check each one is there.
METRIC_NAMES: dict[str, str] = {
    # gateway (per request, as the client sees it)
    "pdmesh_request_success_total": "gateway",
    "pdmesh_request_failure_total": "gateway",
    "pdmesh_prompt_tokens_total": "gateway worker",
    "pdmesh_generation_tokens_total": "gateway worker",
    "pdmesh_time_to_first_token_seconds": "gateway",
    "pdmesh_inter_token_latency_seconds": "gateway",
    "pdmesh_e2e_request_latency_seconds": "gateway",
    "pdmesh_request_time_per_output_token_seconds": "gateway",
    "pdmesh_request_prompt_tokens": "gateway",
    "pdmesh_request_generation_tokens": "gateway",
    "pdmesh_gateway_retries_total": "gateway",
    "pdmesh_requests_migrated_total": "gateway",
    "pdmesh_requests_handed_back_total": "gateway",
    "pdmesh_requests_offloaded_total": "gateway",
    "pdmesh_requests_rejected_total": "gateway",
    "pdmesh_instance_up": "gateway",
    # engine instances (prefill, decode, mixed; one DP rank each)
    "pdmesh_num_requests_running": "worker",
    "pdmesh_num_requests_waiting": "worker",
    "pdmesh_kv_cache_usage_perc": "worker",
    "pdmesh_prefix_cache_queries_total": "worker",
    "pdmesh_prefix_cache_hits_total": "worker",
    "pdmesh_request_queue_time_seconds": "worker",
    "pdmesh_request_prefill_time_seconds": "worker",
    "pdmesh_request_decode_time_seconds": "worker",
    "pdmesh_kv_transfer_bytes_total": "worker",
    "pdmesh_kv_transfer_seconds": "worker",
    "pdmesh_kv_pool_hits_total": "worker",
    "pdmesh_kv_pool_misses_total": "worker",
    "pdmesh_kv_load_timeouts_total": "worker",
    "pdmesh_kv_tier_blocks": "worker (KV tiers)",
    "pdmesh_kv_tier_hits_total": "worker (KV tiers)",
    "pdmesh_kv_tier_queries_total": "worker (KV tiers)",
    "pdmesh_kv_tier_bytes_total": "worker (KV tiers)",
    "pdmesh_kv_tier_copy_seconds": "worker (KV tiers)",
    "pdmesh_num_preemptions_total": "worker",
    "pdmesh_requests_recomputed_total": "worker",
    "pdmesh_spec_decode_num_drafts_total": "worker (speculative decoding)",
    "pdmesh_spec_decode_num_draft_tokens_total": "worker (speculative decoding)",
    "pdmesh_spec_decode_num_accepted_tokens_total": "worker (speculative decoding)",
    "pdmesh_spec_decode_num_accepted_tokens_per_pos_total": "worker (speculative decoding)",
    "pdmesh_dp_bubble_blocks": "worker (DyntraLB)",
    "pdmesh_dyntralb_active": "worker (DyntraLB)",
    "pdmesh_dyntralb_pauses_total": "worker (DyntraLB)",
    "pdmesh_dyntralb_resumes_total": "worker (DyntraLB)",
    "pdmesh_dyntralb_frozen_steps_total": "worker (DyntraLB)",
    "pdmesh_lora_requests_info": "worker (LoRA)",
    "pdmesh_eplb_placement_version": "worker (EP) eplb",
    "pdmesh_eplb_expert_weight_bytes_moved_total": "worker (EP)",
    "pdmesh_eplb_move_seconds_total": "worker (EP)",
    # EPLB controller
    "pdmesh_eplb_decisions_total": "eplb",
    "pdmesh_eplb_balancedness": "eplb",
}


NAMINGS = ("pdmesh", "vllm")  # --metrics-names


class VllmNames:
    """The families of ``sources`` (registries, collectors) under vLLM's own names,
    ``pdmesh_X`` as ``vllm:X`` (pdmesh's names are vLLM's, prefixed): a Grafana
    dashboard built for vLLM reads a pdmesh mesh unchanged (--metrics-names vllm)."""

    def __init__(self, *sources: Any):
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        for source in self.sources:
            for family in source.collect():
                renamed = Metric(_vllm(family.name), family.documentation, family.type,
                                 family.unit)
                renamed.samples = [s._replace(name=_vllm(s.name)) for s in family.samples]
                yield renamed


def _vllm(name: str) -> str:
    return "vllm:" + name[len("pdmesh_"):] if name.startswith("pdmesh_") else name


def serve_metrics(collect: Callable[[], Iterator[Metric]], host: str, port: int,
                  registry: CollectorRegistry | None = None, names: str = "pdmesh"
                  ) -> tuple[int, Callable[[], None]]:
    """Serve ``collect``'s metrics (and ``registry``'s, if given) at
    http://host:port/metrics from a daemon thread, under ``names`` (NAMINGS); returns
    the port (0: a free one) and what stops the server."""

    class _Collector:
        def collect(self) -> Iterator[Metric]:
            try:
                yield from collect()
            except Exception:  # noqa: BLE001 (a scrape must not take the service down)
                log.exception("metrics collection failed")

    registry = registry or CollectorRegistry(auto_describe=False)
    registry.register(_Collector())  # type: ignore[arg-type]
    if names == "vllm":
        served = CollectorRegistry(auto_describe=False)
        served.register(VllmNames(registry))  # type: ignore[arg-type]
        registry = served
    server, _ = start_http_server(port, addr=host, registry=registry)

    def close() -> None:
        server.shutdown()
        server.server_close()

    return int(server.server_port), close


def gauge(name: str, doc: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=list(labels))
    g.add_metric(list(labels.values()), value)
    return g


def counter(name: str, doc: str, labels: dict[str, str], value: float) -> CounterMetricFamily:
    """``name`` without ``_total`` (the exposition adds it)."""
    c = CounterMetricFamily(name, doc, labels=list(labels))
    c.add_metric(list(labels.values()), value)
    return c


def _spec_metrics(stats: Any, labels: dict[str, str]) -> Iterator[Metric]:
    """vLLM's spec_decode counters (engine.spec_stats)."""
    yield counter("pdmesh_spec_decode_num_drafts", "Verifications of one request's draft "
                  "tokens.", labels, stats.num_drafts)
    yield counter("pdmesh_spec_decode_num_draft_tokens", "Draft tokens verified.", labels,
                  stats.num_draft_tokens)
    yield counter("pdmesh_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                  labels, stats.num_accepted_tokens)
    per_pos = CounterMetricFamily("pdmesh_spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by their position among the "
                                  "drafts (0: the first).", labels=[*labels, "position"])
    for position, accepted in enumerate(stats.accepted_per_position):
        per_pos.add_metric([*labels.values(), str(position)], accepted)
    yield per_pos
    yield gauge("pdmesh_spec_decode_draft_length", "Drafts per request the engine chose "
                "for its last drafting decision (adaptive_drafts; else the configured "
                "count).", labels, stats.draft_length)


# request phases take milliseconds to minutes
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class WorkerRequestMetrics:
    """Per-request figures an engine instance observes as requests finish (the engine
    loop calls ``finished``): tokens, and time queued, prefilling and decoding here."""

    def __init__(self, labels: dict[str, str]):
        from prometheus_client import Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=False)
        names, values = list(labels), list(labels.values())

        def hist(name: str, doc: str):
            return Histogram(name, doc, names, buckets=LATENCY_BUCKETS,
                             registry=self.registry).labels(*values)

        self.queue = hist("pdmesh_request_queue_time_seconds",
                          "Time from arrival here to first scheduled.")
        self.prefill = hist("pdmesh_request_prefill_time_seconds",
                            "Time from first scheduled to the first token produced here.")
        self.decode = hist("pdmesh_request_decode_time_seconds",
                           "Time from the first token produced here to finishing.")
        self.prompt = Counter("pdmesh_prompt_tokens", "Prompt tokens of finished requests.",
                              names, registry=self.registry).labels(*values)
        self.generated = Counter("pdmesh_generation_tokens", "Tokens generated here.",
                                 names, registry=self.registry).labels(*values)

    def finished(self, req) -> None:
        if req.scheduled_time is None:  # aborted while waiting
            return
        self.queue.observe(max(0.0, req.scheduled_time - req.arrival_time))
        if req.first_token_time is not None:
            self.prefill.observe(max(0.0, req.first_token_time - req.scheduled_time))
            self.decode.observe(max(0.0, time.monotonic() - req.first_token_time))
        self.prompt.inc(req.num_prompt_tokens)
        self.generated.inc(req.num_output_tokens - req.num_carried_outputs)


def _lora_info(sched: Any, max_loras: int, labels: dict[str, str]) -> Metric:
    """vLLM's lora_requests_info: the LoRA adapters the running and the waiting requests
    run (comma-separated, in their order) and the device slots; its value the scrape's
    time, as vLLM sets it."""
    def names(requests: Any) -> str:
        try:  # (the engine's thread moves them meanwhile: a copy, or none this time)
            found = list(requests)
        except RuntimeError:
            return ""
        return ",".join(dict.fromkeys(r.lora.lora_name for r in found if r.lora is not None))

    info = GaugeMetricFamily("pdmesh_lora_requests_info", "Running stats on lora requests.",
                             labels=[*labels, "max_lora", "waiting_lora_adapters",
                                     "running_lora_adapters"])
    info.add_metric([*labels.values(), str(max_loras), names(sched.waiting),
                     names(sched.running)], time.time())
    return info


TIER_DIRECTIONS = ("to_host", "from_host", "to_storage", "from_storage")


def _observe(family: HistogramMetricFamily, hist: dict, key: str, new: list[float],
             labels: dict[str, str]) -> None:
    """Add ``new`` observations to the cumulative histogram ``hist[key]`` and the
    family's sample for ``key``."""
    counts, total = hist[key]
    for t in new:
        for i, bound in enumerate(LATENCY_BUCKETS):
            counts[i] += t <= bound
        counts[-1] += 1
        total[0] += t
    buckets = [(str(b), c) for b, c in zip(LATENCY_BUCKETS, counts, strict=False)]
    family.add_metric([*labels.values(), key], buckets + [("+Inf", counts[-1])], total[0])


def _tier_metrics(tier, labels: dict[str, str], hist: dict) -> Iterator[Metric]:
    """The KV tiers' (engine/kv_tiers.py): occupancy, hits, bytes moved, copy times."""
    blocks = GaugeMetricFamily("pdmesh_kv_tier_blocks", "KV blocks the host tier holds, "
                               "and its capacity.", labels=[*labels, "what"])
    blocks.add_metric([*labels.values(), "held"], sum(tier.occupancy()))
    blocks.add_metric([*labels.values(), "capacity"], sum(tier.capacity_blocks))
    yield blocks
    hits = CounterMetricFamily("pdmesh_kv_tier_hits", "KV blocks read back from a tier "
                               "(host: host memory; storage: the storage backend).",
                               labels=[*labels, "tier"])
    for name, n in tier.stats.hits.items():
        hits.add_metric([*labels.values(), name], n)
    yield hits
    yield counter("pdmesh_kv_tier_queries", "KV blocks asked of the tiers.", labels,
                  tier.stats.queries)
    moved = CounterMetricFamily("pdmesh_kv_tier_bytes", "KV bytes copied between the "
                                "tiers.", labels=[*labels, "direction"])
    seconds = HistogramMetricFamily("pdmesh_kv_tier_copy_seconds", "Time of one copy "
                                    "between tiers (a batch of blocks).",
                                    labels=[*labels, "direction"])
    for d in TIER_DIRECTIONS:
        moved.add_metric([*labels.values(), d], tier.stats.bytes[d])
        _observe(seconds, hist, d, tier.stats.take_seconds(d), labels)
    yield moved
    yield seconds


def worker_metrics(loop, labels: dict[str, str], eplb=None) -> Callable[[], Iterator[Metric]]:
    """What an engine instance (prefill, decode, mixed; one DP rank) exports at scrape
    time (the per-request histograms are in WorkerRequestMetrics)."""
    # per direction: [cumulative count per bucket..., +Inf count], and the sum of seconds
    hist = {d: ([0] * (len(LATENCY_BUCKETS) + 1), [0.0]) for d in ("put", "get")}
    tier_hist = {d: ([0] * (len(LATENCY_BUCKETS) + 1), [0.0]) for d in TIER_DIRECTIONS}

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
        yield counter("pdmesh_prefix_cache_queries", "Prompt tokens looked up in the local "
                      "prefix cache.", labels, sched.prefix_queries)
        yield counter("pdmesh_prefix_cache_hits", "Prompt tokens found in the local prefix "
                      "cache.", labels, sched.prefix_hits)
        conn = loop.engine.connector
        if conn is not None:
            moved = CounterMetricFamily("pdmesh_kv_transfer_bytes", "KV bytes moved between "
                                        "this instance and the pool.", labels=[*labels,
                                                                               "direction"])
            seconds = HistogramMetricFamily("pdmesh_kv_transfer_seconds", "Time of one KV "
                                            "transfer (a request's blocks, one direction).",
                                            labels=[*labels, "direction"])
            for direction in ("put", "get"):
                moved.add_metric([*labels.values(), direction],
                                 conn.transfer_bytes[direction])
                _observe(seconds, hist, direction, conn.take_transfer_seconds(direction),
                         labels)
            yield moved
            yield seconds
            stats = conn.pool.stats() if conn.pool is not None else None  # (tiers alone)
            yield counter("pdmesh_kv_pool_hits", "Blocks found in the KV pool.", labels,
                          stats.hits if stats else 0)
            yield counter("pdmesh_kv_pool_misses", "Blocks looked for in the KV pool and "
                          "not found.", labels, stats.misses if stats else 0)
            yield counter("pdmesh_kv_load_timeouts", "Pool reads given up after "
                          "--kv-load-timeout (the prompt was computed here).", labels,
                          sched.kv_load_timeouts)
            if getattr(conn, "tier", None) is not None:
                yield from _tier_metrics(conn.tier, labels, tier_hist)
        yield counter("pdmesh_num_preemptions", "Requests that gave up their KV blocks "
                      "(recomputed here, or handed back).", labels, sched.preemptions)
        yield counter("pdmesh_requests_recomputed", "Requests the recompute scheduler "
                      "handed back to be re-prefilled elsewhere.", labels, sched.recomputed)
        if loop.engine.speculative is not None:
            yield from _spec_metrics(loop.engine.spec_stats, labels)
        if loop.engine.lora is not None:
            yield _lora_info(sched, loop.engine.lora.max_loras, labels)
        lb = loop.engine.dyntralb
        if lb is not None:
            yield gauge("pdmesh_dp_bubble_blocks", "DP bubble at the last step: max - mean "
                        "active KV blocks over the ranks (a ratio below 1 in ratio mode).",
                        labels, lb.last_bubble)
            yield gauge("pdmesh_dyntralb_active", "1 while DyntraLB balances.", labels,
                        int(lb.active))
            yield counter("pdmesh_dyntralb_pauses", "Running requests DyntraLB paused.",
                          labels, sched.pauses)
            yield counter("pdmesh_dyntralb_resumes", "Paused requests that ran again.",
                          labels, sched.resumes)
            yield counter("pdmesh_dyntralb_frozen_steps", "Steps this rank was frozen for "
                          "admission by DyntraLB.", labels, lb.frozen_steps)
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
