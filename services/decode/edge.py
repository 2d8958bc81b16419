"""The decode (and mixed) instance's gRPC edge: ``Decode`` over an EngineClient, run in
a process of its own (shared.runtime.edge) or on a thread of the engine's."""

from __future__ import annotations

import sys

from pdmesh.services.decode.server import DecodeServicer
from pdmesh.shared.infra.tracing import Tracing
from pdmesh.shared.proto import decode_pb2_grpc
from pdmesh.shared.runtime.edge import EdgeConfig, serve_edge


def add_servicer(server, client, config: EdgeConfig) -> None:
    tracing = Tracing(f"pdmesh-{config.role}", config.otlp_endpoint)
    servicer = DecodeServicer(client, config.model_name, role=config.role, tracing=tracing,
                              model_path=config.model_path, runner=config.runner)
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)


if __name__ == "__main__":
    sys.exit(serve_edge(add_servicer))
