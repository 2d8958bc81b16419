"""`pdmesh prefill`: an engine in producer mode behind the Prefill gRPC service."""

from __future__ import annotations

from pdmesh.shared.config.serve import ServeConfig
from pdmesh.shared.runtime.engine_service import EngineRole, serve_engine

EDGE_MODULE = "pdmesh.services.prefill.edge"


def run(config: ServeConfig) -> int:
    from pdmesh.services.prefill.edge import add_servicer

    return serve_engine(config, EngineRole("prefill", add_servicer, EDGE_MODULE))
