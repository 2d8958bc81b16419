"""One trace per request across the services (OpenTelemetry, exported over OTLP/gRPC).

    gateway  "POST /v1/..." (server; parent: the client's ``traceparent`` if any)
      ├─ "route"            which instances, and why
      ├─ "prefill"          (client) ──gRPC metadata──▶ prefill "prefill" (server)
      │                                                   ├─ "queue"  ├─ "compute"
      │                                                   └─ "kv.put"
      ├─ "decode"           (client, one per attempt) ──in the request──▶ decode "decode"
      │                                                   ├─ "kv.get" ├─ "queue"
      │                                                   └─ "first_token"
      └─ "recompute"        a re-prefill after a decode instance handed the request back

Off unless ``--enable-trace`` or ``--otlp-traces-endpoint`` is given; off, every helper
here returns at once and nothing else is imported. The decode hop carries the context
inside the request message, because many requests share one Session stream (and so
one set of gRPC metadata); every unary call carries it in metadata.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)


def endpoint_from_args(a: Any) -> str | None:
    """The collector a service's flags (--otlp-traces-endpoint, --enable-trace) name."""
    return a.otlp_traces_endpoint or ("http://127.0.0.1:4317" if a.enable_trace else None)


class Tracing:
    """A service's tracer, or nothing (``enabled`` False) at no cost."""

    def __init__(self, service: str, endpoint: str | None):
        self.enabled = endpoint is not None
        self.endpoint = endpoint
        self.tracer: Any = None
        self._provider: Any = None
        if not self.enabled:
            return
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self._provider = TracerProvider(resource=Resource.create({"service.name": service}))
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self._provider.get_tracer("pdmesh")
        log.info("tracing to %s as %s", endpoint, service)

    @classmethod
    def from_args(cls, service: str, a: Any) -> Tracing:
        return cls(service, endpoint_from_args(a))

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()

    # -- context ------------------------------------------------------------------------
    @staticmethod
    def extract(carrier: Mapping[str, str]) -> Any:
        from opentelemetry.propagate import extract

        return extract(dict(carrier))

    @staticmethod
    def inject(ctx: Any = None) -> dict[str, str]:
        """The W3C headers (traceparent, tracestate) of ``ctx`` or the current span."""
        from opentelemetry.propagate import inject

        out: dict[str, str] = {}
        inject(out, context=ctx)
        return out

    @staticmethod
    def context_of(span: Any) -> Any:
        from opentelemetry import trace

        return trace.set_span_in_context(span)

    # -- spans ----------------------------------------------------------------------------
    def start(self, name: str, parent: Any = None, kind: str = "internal",
              attributes: Mapping[str, Any] | None = None, start_ns: int | None = None) -> Any:
        from opentelemetry.trace import SpanKind

        return self.tracer.start_span(name, context=parent, kind=getattr(SpanKind, kind.upper()),
                                      attributes=dict(attributes or {}), start_time=start_ns)

    def record(self, name: str, parent_span: Any, start_mono: float | None,
               end_mono: float | None, attributes: Mapping[str, Any] | None = None) -> None:
        """A finished child span from two time.monotonic() readings taken earlier."""
        if start_mono is None or end_mono is None:
            return
        span = self.start(name, self.context_of(parent_span), attributes=attributes,
                          start_ns=wall_ns(start_mono))
        span.end(end_time=wall_ns(end_mono))


def wall_ns(mono: float) -> int:
    """A time.monotonic() reading as wall-clock nanoseconds (what spans carry)."""
    return time.time_ns() - int((time.monotonic() - mono) * 1e9)
