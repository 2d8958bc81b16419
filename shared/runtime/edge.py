"""An engine's gRPC edge in a process of its own (vLLM's API-server / engine-core split).

The engine process starts the edge, hands it one end of a socket pair and keeps
stepping in its main thread; the edge runs grpc.aio with a ``RemoteEngineClient`` over
the other end. gRPC's Python work (protobuf, the aio poller, event-loop wake-ups) then
runs on another core instead of between the engine's steps, under its GIL.

    engine process: start_edge() ──spawn──▶ edge process: serve_edge(add_servicer)
                    EngineLoop(SocketPort)      RemoteEngineClient + the role's servicer
                    edge_port() ◀── EdgeListening(port) | EdgeFailed(message)

Lifetimes: the edge lives as long as its link. It ignores SIGTERM / SIGINT (the engine
drains and then closes the link), exits when the engine's end closes, and the kernel
kills it if the engine process dies (PR_SET_PDEATHSIG); the engine stops when the edge
goes away.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from pdmesh.shared.infra.launcher import die_with_parent
from pdmesh.shared.runtime.client import EngineClient, RemoteEngineClient
from pdmesh.shared.runtime.link import SocketPort
from pdmesh.shared.runtime.protocol import EdgeFailed, EdgeListening, encode


@dataclass
class EdgeConfig:
    """What the edge process needs to know, passed as JSON on its command line."""

    role: str
    host: str
    port: int
    model_name: str
    otlp_endpoint: str | None = None
    log_level: str = "info"
    log_format: str = "text"
    fd: int = -1
    model_path: str = ""  # the folder the engine loaded (Health says it)
    runner: str = "generate"  # or pooling: the engine serves embeddings (Health says it)


def start_edge(module: str, config: EdgeConfig) -> tuple[subprocess.Popen, SocketPort]:
    """Spawn ``python -m module`` as this engine's edge; returns at once (the edge
    imports and binds while the engine loads), ``edge_port`` waits for its port."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    config.fd = theirs.fileno()
    proc = subprocess.Popen([sys.executable, "-m", module, json.dumps(asdict(config))],
                            pass_fds=(theirs.fileno(),), preexec_fn=die_with_parent)
    theirs.close()
    return proc, SocketPort(ours)


def edge_port(proc: subprocess.Popen, port: SocketPort, timeout_s: float = 60.0) -> int:
    """The port the edge bound, once it serves; ValueError with the edge's message if
    it could not serve what the flags asked, RuntimeError if it died."""
    message = port.receive_one(timeout_s)
    if isinstance(message, EdgeListening):
        return message.port
    stop_edge(proc, port)
    if isinstance(message, EdgeFailed):
        raise ValueError(message.message)
    raise RuntimeError(f"the gRPC edge process did not start (exit status "
                       f"{proc.returncode}; its error is above)")


def stop_edge(proc: subprocess.Popen, port: SocketPort) -> None:
    """After the engine loop returned: closing the link ends the edge."""
    port.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


AddServicer = Callable[[Any, EngineClient, EdgeConfig], None]


def serve_edge(add_servicer: AddServicer) -> int:
    """The edge process's main: ``add_servicer(server, client, config)`` adds the
    role's servicer over the engine client."""
    from pdmesh.shared.infra.logs import setup_logging

    config = EdgeConfig(**json.loads(sys.argv[1]))
    setup_logging(config.log_level, config.log_format)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the engine drains, then closes the link
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return asyncio.run(_serve(config, add_servicer))


async def _serve(config: EdgeConfig, add_servicer: AddServicer) -> int:
    import grpc

    sock = socket.socket(fileno=config.fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    client = RemoteEngineClient(reader, writer)
    from pdmesh.shared.infra import cluster_auth, tls

    server = grpc.aio.server(interceptors=cluster_auth.aio_server_interceptors())
    add_servicer(server, client, config)
    host = f"[{config.host}]" if ":" in config.host else config.host
    try:
        port = tls.add_port(server, f"{host}:{config.port}")
    except RuntimeError as e:  # the engine process reports it (and exits with it)
        writer.write(encode(EdgeFailed(f"--port: cannot listen on {config.host}:"
                                       f"{config.port} ({e})")))
        await writer.drain()
        return 2
    await server.start()
    writer.write(encode(EdgeListening(port)))
    await client.run()  # until the engine closes the link
    await server.stop(grace=1)
    return 0
