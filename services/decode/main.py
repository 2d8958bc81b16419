"""`pdmesh decode` / `pdmesh mixed`: an engine in consumer mode (or one that prefills
too, without a pool) behind the streaming Decode gRPC service."""

from __future__ import annotations

from pdmesh.shared.config.serve import ServeConfig
from pdmesh.shared.runtime.engine_service import EngineRole, serve_engine

EDGE_MODULE = "pdmesh.services.decode.edge"


def run(config: ServeConfig) -> int:
    """``config.role``: decode, or mixed (the same service on an engine that prefills too,
    without a pool)."""
    from pdmesh.services.decode.edge import add_servicer

    return serve_engine(config, EngineRole(config.role, add_servicer, EDGE_MODULE))
