"""`pdmesh prefill`: an engine in producer mode behind the Prefill gRPC service."""

from __future__ import annotations

import argparse

import grpc

from pdmesh.services.prefill.server import PrefillServicer
from pdmesh.shared.proto import prefill_pb2_grpc
from pdmesh.shared.runtime.loop import EngineLoop
from pdmesh.shared.runtime.worker import add_worker_args as add_args
from pdmesh.shared.runtime.worker import serve_worker


def _add(server: grpc.aio.Server, loop: EngineLoop, model_name: str, tracing) -> None:
    prefill_pb2_grpc.add_PrefillServicer_to_server(
        PrefillServicer(loop, model_name, tracing=tracing), server)


def run(a: argparse.Namespace) -> int:
    return serve_worker(a, "prefill", _add)


__all__ = ["add_args", "run"]
