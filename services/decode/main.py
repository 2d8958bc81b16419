"""`pdmesh decode` / `pdmesh mixed`: an engine in consumer mode (or one that prefills
too, without a pool) behind the streaming Decode gRPC service."""

from __future__ import annotations

import argparse

from pdmesh.shared.config.engine_config import add_engine_service_args as add_args
from pdmesh.shared.config.engine_config import resolve_engine
from pdmesh.shared.runtime.engine_service import EngineRole, serve_engine

EDGE_MODULE = "pdmesh.services.decode.edge"


def run(a: argparse.Namespace, role: str = "decode") -> int:
    from pdmesh.services.decode.edge import add_servicer

    config, service = resolve_engine(a, role)
    return serve_engine(a, EngineRole(role, add_servicer, EDGE_MODULE), config, service)


__all__ = ["add_args", "run"]
