"""The decode (and mixed) instance's gRPC edge process: `Decode` served from here, the
engine stepping in the process that started it (pdmesh.shared.runtime.edge)."""

from __future__ import annotations

import sys

from pdmesh.services.decode.server import DecodeServicer
from pdmesh.shared.infra.tracing import Tracing
from pdmesh.shared.proto import decode_pb2_grpc
from pdmesh.shared.runtime.edge import EdgeConfig, serve_edge


def add_servicer(server, remote, config: EdgeConfig) -> None:
    tracing = Tracing(f"pdmesh-{config.role}", config.otlp_endpoint)
    servicer = DecodeServicer(remote, config.model_name, role=config.role, tracing=tracing)
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)


if __name__ == "__main__":
    sys.exit(serve_edge(add_servicer))
