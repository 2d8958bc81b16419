"""What mutual TLS costs gRPC itself, on loopback, with the mesh's own listeners and
channels (shared/infra/tls.py): a server streaming small messages to one aio client (as
a decode instance streams tokens to the gateway), and small unary round trips (as the
gateway's prefill calls), plain and TLS alternated, best of three each.

    .venv/bin/python scripts/bench_grpc_tls.py
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

import grpc

from pdmesh.shared.infra import tls

STREAMED = 20000  # messages per stream
CALLS = 2000  # unary calls per pass


def _raw(b: bytes) -> bytes:
    return b


async def _server() -> tuple[grpc.aio.Server, int]:
    async def stream(request, context):
        for _ in range(STREAMED):
            yield b"x" * 40  # about one token's chunk

    async def echo(request, context):
        return request

    handler = grpc.method_handlers_generic_handler("bench.B", {
        "S": grpc.unary_stream_rpc_method_handler(stream, request_deserializer=_raw,
                                                  response_serializer=_raw),
        "U": grpc.unary_unary_rpc_method_handler(echo, request_deserializer=_raw,
                                                 response_serializer=_raw)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = tls.add_port(server, "127.0.0.1:0")
    await server.start()
    return server, port


async def measure() -> tuple[float, float]:
    """(microseconds per streamed message, microseconds per unary call)."""
    server, port = await _server()
    channel = tls.aio_channel(f"127.0.0.1:{port}")
    stream = channel.unary_stream("/bench.B/S", request_serializer=_raw,
                                  response_deserializer=_raw)
    unary = channel.unary_unary("/bench.B/U", request_serializer=_raw,
                                response_deserializer=_raw)
    await unary(b"warm up: the handshake")
    per_message, per_call = [], []
    for _ in range(3):
        t0, n = time.perf_counter(), 0
        async for _ in stream(b""):
            n += 1
        per_message.append((time.perf_counter() - t0) / n * 1e6)
        t0 = time.perf_counter()
        for _ in range(CALLS):
            await unary(b"x" * 200)
        per_call.append((time.perf_counter() - t0) / CALLS * 1e6)
    await channel.close()
    await server.stop(None)
    return min(per_message), min(per_call)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        tls.write(Path(folder))
        for mode in ("plain", "tls", "plain", "tls"):
            if mode == "tls":
                os.environ[tls.TLS_DIR_ENV] = folder
            else:
                os.environ.pop(tls.TLS_DIR_ENV, None)
            message_us, call_us = asyncio.run(measure())
            print(f"{mode:5s} streamed {message_us:6.1f} us/message   unary {call_us:6.0f} "
                  "us/call", flush=True)


if __name__ == "__main__":
    main()
