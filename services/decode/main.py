"""`pdmesh decode`: an engine in consumer mode behind the streaming Decode gRPC service."""

from __future__ import annotations

import argparse

import grpc

from services.decode.server import DecodeServicer
from shared.engine.loop import EngineLoop
from shared.proto import decode_pb2_grpc
from shared.worker import serve_worker


def _add(server: grpc.Server, loop: EngineLoop, model_name: str) -> None:
    decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(loop, model_name), server)


def run(a: argparse.Namespace) -> int:
    return serve_worker(a, "decode", _add)
