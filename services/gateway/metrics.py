"""The gateway's /metrics: requests as clients see them (vLLM's names, pdmesh_), what
the mesh had to do for them, and which instances the router sees."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdmesh.services.gateway.router import Router


class GatewayMetrics:
    """The gateway's /metrics: requests as clients see them (vLLM's names, pdmesh_), what
    the mesh had to do for them, and which instances the router sees."""

    def __init__(self, model: str, router: Router | None = None,
                 max_model_len: int = 1 << 20) -> None:
        from pdmesh.shared.infra.metrics import LATENCY_BUCKETS  # (turns off _created too)

        self.registry = CollectorRegistry()
        m = {"model_name": model}
        reg = self.registry
        self._success = Counter("pdmesh_request_success", "Finished requests",
                                ["model_name", "finished_reason"], registry=reg)
        self.model = model
        self.prompt_tokens = Counter("pdmesh_prompt_tokens", "Prompt tokens of finished "
                                     "requests", list(m), registry=reg).labels(**m)
        self.generation_tokens = Counter("pdmesh_generation_tokens", "Generated tokens "
                                         "sent to clients", list(m), registry=reg).labels(**m)
        self.failures = Counter("pdmesh_request_failure", "Requests that failed",
                                list(m), registry=reg).labels(**m)
        self.ttft = Histogram("pdmesh_time_to_first_token_seconds", "Arrival to the first "
                              "token", list(m), buckets=LATENCY_BUCKETS,
                              registry=reg).labels(**m)
        self.itl = Histogram("pdmesh_inter_token_latency_seconds", "Between two tokens of "
                             "a response", list(m), buckets=LATENCY_BUCKETS,
                             registry=reg).labels(**m)
        self.e2e = Histogram("pdmesh_e2e_request_latency_seconds", "Arrival to the last "
                             "token", list(m), buckets=LATENCY_BUCKETS,
                             registry=reg).labels(**m)
        self.tpot = Histogram("pdmesh_request_time_per_output_token_seconds", "A "
                              "request's mean time per output token after the first",
                              list(m), buckets=LATENCY_BUCKETS, registry=reg).labels(**m)
        lengths = _one_two_five(max_model_len)
        self.request_prompt_tokens = Histogram(
            "pdmesh_request_prompt_tokens", "Prompt tokens per finished request", list(m),
            buckets=lengths, registry=reg).labels(**m)
        self.request_generation_tokens = Histogram(
            "pdmesh_request_generation_tokens", "Generated tokens per finished request",
            list(m), buckets=lengths, registry=reg).labels(**m)
        self._retries = Counter("pdmesh_gateway_retries", "Calls retried on another "
                                "instance", ["model_name", "role"], registry=reg)
        for role in ("prefill", "decode"):  # exported at 0 from the start
            self._retries.labels(model_name=model, role=role)
        self.migrated = Counter("pdmesh_requests_migrated", "Requests continued on another "
                                "decode instance after theirs failed mid-stream", list(m),
                                registry=reg).labels(**m)
        self.handed_back = Counter("pdmesh_requests_handed_back", "Requests a decode "
                                   "instance handed back (recompute scheduler) and the "
                                   "gateway re-prefilled", list(m), registry=reg).labels(**m)
        self.offloaded = Counter("pdmesh_requests_offloaded", "Requests whose prompt a "
                                 "decode instance computed itself because prefill was "
                                 "backed up (--prefill-offload-threshold)", list(m),
                                 registry=reg).labels(**m)
        self.rejected = Counter("pdmesh_requests_rejected", "Requests answered 429 "
                                "(queue limits)", list(m), registry=reg).labels(**m)
        if router is not None:
            reg.register(InstancesUp(router, model))  # type: ignore[arg-type]

    def success(self, reason: str) -> None:
        self._success.labels(model_name=self.model, finished_reason=reason).inc()

    # what a journey reports (services/gateway/journey.py: MeshEvents)
    def retried(self, role: str) -> None:
        self._retries.labels(model_name=self.model, role=role).inc()


def _one_two_five(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return [float(b) for b in out]
            out.append(m * scale)
        scale *= 10


class InstancesUp:
    """pdmesh_instance_up{instance, role, address}: 1 for each instance the router would
    route to (heartbeat fresh, not draining), read when scraped."""

    def __init__(self, router: Router, model: str):
        self.router = router
        self.model = model

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        g = GaugeMetricFamily("pdmesh_instance_up", "Instances the gateway routes to",
                              labels=["model_name", "instance", "role", "address"])
        for role in ("prefill", "decode", "mixed"):
            for runner in ("generate", "pooling"):  # (embedding instances are routed to too)
                for inst in self.router.instances(role, runner):
                    g.add_metric([self.model, inst.id, role, inst.address], 1)
        yield g
