"""The prefill instance's gRPC edge: ``Prefill`` over an EngineClient, run in a process
of its own (shared.runtime.edge) or on a thread of the engine's."""

from __future__ import annotations

import sys

from pdmesh.services.prefill.server import PrefillServicer
from pdmesh.shared.infra.tracing import Tracing
from pdmesh.shared.proto import prefill_pb2_grpc
from pdmesh.shared.runtime.edge import EdgeConfig, serve_edge


def add_servicer(server, client, config: EdgeConfig) -> None:
    tracing = Tracing("pdmesh-prefill", config.otlp_endpoint)
    prefill_pb2_grpc.add_PrefillServicer_to_server(
        PrefillServicer(client, config.model_name, tracing=tracing,
                        model_path=config.model_path, runner=config.runner), server)


if __name__ == "__main__":
    sys.exit(serve_edge(add_servicer))
