"""One trace per request across gateway, prefill and decode, exported over OTLP/gRPC to
a small receiver in this test (the services' real exporter, a real gRPC server)."""

from __future__ import annotations

import json
import threading
import time
from concurrent import futures

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pdmesh.shared.infra.launcher import Service
from tests.mesh import stop_all

ENGINE = ["--device", "cpu", "--dtype", "float32", "--block-size", "16",
          "--pool-segment-mb", "64"]
MODEL = "tiny"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []  # (service name, span)
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (the OTLP method)
        with self.lock:
            for rs in request.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes
                               if a.key == "service.name")
                for ss in rs.scope_spans:
                    self.spans += [(service, s) for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def receiver():
    rec = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield rec, f"http://127.0.0.1:{port}"
    finally:
        server.stop(0)


def test_one_trace_per_request_nested_across_services(qwen3_path, receiver, tmp_path,
                                                       registry_prefix):
    rec, endpoint = receiver
    reg = ["--registry-prefix", registry_prefix + "-trace"]
    tracing = ["--otlp-traces-endpoint", endpoint]
    fast_export = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # ms between exports
    started: list[Service] = []
    try:
        kv = Service("kvstore", ["kvstore", *reg], tmp_path)
        started.append(kv)
        for role in ("prefill", "decode"):
            started.append(Service(role, [role, str(qwen3_path), "--kvstore", kv.address,
                                          "--served-model-name", MODEL, *ENGINE, *reg,
                                          *tracing], tmp_path, env=fast_export))
        gw = Service("gateway", ["gateway", str(qwen3_path), "--port", "0",
                                 "--served-model-name", MODEL, *reg, *tracing,
                                 "--log-requests", "--log-format", "json"], tmp_path,
                     env=fast_export)
        started.append(gw)
        r = httpx.post(gw.info["http"] + "/v1/completions", timeout=60,
                       headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"},
                       json={"model": MODEL, "prompt": list(range(40, 80)), "max_tokens": 8,
                             "temperature": 0, "ignore_eos": True, "stream": True})
        assert r.status_code == 200
        wanted = {("pdmesh-gateway", "POST /v1/completions"), ("pdmesh-gateway", "prefill"),
                  ("pdmesh-gateway", "decode"), ("pdmesh-prefill", "prefill"),
                  ("pdmesh-prefill", "compute"), ("pdmesh-prefill", "kv.put"),
                  ("pdmesh-decode", "decode"), ("pdmesh-decode", "kv.get"),
                  ("pdmesh-decode", "first_token")}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with rec.lock:
                have = {(svc, s.name) for svc, s in rec.spans}
            if wanted <= have:
                break
            time.sleep(0.1)
        assert wanted <= have, wanted - have
    finally:
        stop_all(started)
    # --log-requests --log-format json: the request's line carries its ids
    lines = [json.loads(ln) for ln in gw.log_path.read_text().splitlines()
             if ln.startswith("{")]
    logged = [ln for ln in lines if ln["logger"] == "pdmesh.requests"]
    assert len(logged) == 1, lines
    assert logged[0]["trace_id"] == TRACE_ID and logged[0]["request_id"].startswith("cmpl-")
    entry = logged[0]["request"]
    assert entry["prompt_tokens"] == 40 and entry["completion_tokens"] == 8
    assert entry["finish_reason"] == "length" and "input" in entry and "output" in entry
    with rec.lock:
        spans = {(svc, s.name): s for svc, s in rec.spans}
    # one trace: the caller's
    assert {s.trace_id.hex() for s in spans.values()} == {TRACE_ID}
    request = spans[("pdmesh-gateway", "POST /v1/completions")]
    assert request.parent_span_id.hex() == CALLER_SPAN

    def parent(svc: str, name: str) -> object:
        pid = spans[(svc, name)].parent_span_id
        return next(k for k, s in spans.items() if s.span_id == pid)

    assert parent("pdmesh-gateway", "prefill") == ("pdmesh-gateway", "POST /v1/completions")
    assert parent("pdmesh-gateway", "decode") == ("pdmesh-gateway", "POST /v1/completions")
    assert parent("pdmesh-prefill", "prefill") == ("pdmesh-gateway", "prefill")
    assert parent("pdmesh-decode", "decode") == ("pdmesh-gateway", "decode")
    for child in ("compute", "kv.put", "queue"):
        assert parent("pdmesh-prefill", child) == ("pdmesh-prefill", "prefill")
    for child in ("kv.get", "first_token"):
        assert parent("pdmesh-decode", child) == ("pdmesh-decode", "decode")
    # children sit inside their parents in time
    outer = spans[("pdmesh-prefill", "prefill")]
    inner = spans[("pdmesh-prefill", "compute")]
    assert outer.start_time_unix_nano <= inner.start_time_unix_nano
    assert inner.end_time_unix_nano <= outer.end_time_unix_nano + 5_000_000
