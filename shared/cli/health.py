"""`pdmesh health`: one probe for container healthchecks and Kubernetes probes.

    pdmesh health --service prefill --grpc 127.0.0.1:50200   # Health RPC: serving?
    pdmesh health --http http://127.0.0.1:8000/health         # HTTP 200?
Exit 0 when healthy, 1 otherwise (with the reason on stderr). An engine is unhealthy
while draining, and while it has had work without finishing a step for more than
``--stall-timeout`` seconds (a hung step: a liveness probe restarts it).
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

import grpc

from pdmesh.shared.infra import cluster_auth
from pdmesh.shared.proto import (
    common_pb2,
    decode_pb2_grpc,
    eplb_pb2_grpc,
    kvstore_pb2_grpc,
    prefill_pb2_grpc,
)

STUBS = {"prefill": prefill_pb2_grpc.PrefillStub, "decode": decode_pb2_grpc.DecodeStub,
         "mixed": decode_pb2_grpc.DecodeStub, "kvstore": kvstore_pb2_grpc.KVStoreStub,
         "eplb": eplb_pb2_grpc.EplbStub}


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--grpc", help="HOST:PORT of a gRPC service")
    g.add_argument("--http", help="URL that must answer 200")
    p.add_argument("--service", choices=sorted(STUBS), default="kvstore")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--stall-timeout", type=float, default=10.0,
                   help="an engine stalled longer than this is unhealthy (0: never)")


def run(a: argparse.Namespace) -> int:
    if a.http:
        try:
            with urllib.request.urlopen(a.http, timeout=a.timeout) as r:
                return 0 if r.status == 200 else 1
        except (urllib.error.URLError, OSError) as e:
            print(f"unhealthy: {a.http}: {e}", file=sys.stderr)
            return 1
    stub = STUBS[a.service](cluster_auth.channel(a.grpc))
    try:
        resp = stub.Health(common_pb2.HealthRequest(), timeout=a.timeout)
    except grpc.RpcError as e:
        print(f"unhealthy: {a.grpc}: {e.code().name}", file=sys.stderr)
        return 1
    if not resp.serving:
        print(f"unhealthy: {a.grpc}: not serving (starting or draining)", file=sys.stderr)
        return 1
    stalled_s = resp.load.stalled_ms / 1000
    if a.stall_timeout > 0 and stalled_s > a.stall_timeout:
        print(f"unhealthy: {a.grpc}: stalled for {stalled_s:.1f} s (work, no step done)",
              file=sys.stderr)
        return 1
    return 0
