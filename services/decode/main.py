"""`pdmesh decode`: an engine in consumer mode behind the streaming Decode gRPC service."""

from __future__ import annotations

import argparse

import grpc

from pdmesh.services.decode.server import DecodeServicer
from pdmesh.shared.proto import decode_pb2_grpc
from pdmesh.shared.runtime.loop import EngineLoop
from pdmesh.shared.runtime.worker import add_worker_args as add_args
from pdmesh.shared.runtime.worker import serve_worker


def run(a: argparse.Namespace, role: str = "decode") -> int:
    """``role`` "mixed": the same service on an engine that prefills too (no pool)."""

    def add(server: grpc.aio.Server, loop: EngineLoop, model_name: str, tracing) -> None:
        servicer = DecodeServicer(loop, model_name, role=role, tracing=tracing)
        decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)

    return serve_worker(a, role, add, edge_module="pdmesh.services.decode.edge")


__all__ = ["add_args", "run"]
