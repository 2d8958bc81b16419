"""`pdmesh prefill`: an engine in producer mode behind the Prefill gRPC service."""

from __future__ import annotations

import argparse

from pdmesh.shared.config.engine_config import add_engine_service_args as add_args
from pdmesh.shared.config.engine_config import resolve_engine
from pdmesh.shared.runtime.engine_service import EngineRole, serve_engine

EDGE_MODULE = "pdmesh.services.prefill.edge"


def run(a: argparse.Namespace) -> int:
    from pdmesh.services.prefill.edge import add_servicer

    config, service = resolve_engine(a, "prefill")
    return serve_engine(a, EngineRole("prefill", add_servicer, EDGE_MODULE), config, service)


__all__ = ["add_args", "run"]
