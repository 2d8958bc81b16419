"""A worker's gRPC edge in a process of its own (vLLM's API-server / engine-core split).

The engine process starts the edge, hands it one end of a socket pair and keeps
stepping in its main thread; the edge runs grpc.aio, turns requests into ``add`` /
``abort`` messages and the engine's per-step events back into stream messages. gRPC's
Python work (protobuf, the aio poller, event-loop wake-ups) then runs on another core
instead of between the engine's steps under its GIL.

    engine process:  start_edge() ──spawn──▶ edge process: serve_edge()
                     EngineLoop.attach_link(EngineLink)      RemoteEngineLoop + servicer

Lifetimes: the edge lives as long as its link. It ignores SIGTERM / SIGINT (the engine
drains and then closes the link), exits when the engine's end closes, and the kernel
kills it if the engine process dies (PR_SET_PDEATHSIG); the engine stops when the edge
goes away.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import pickle
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.infra.launcher import die_with_parent
from pdmesh.shared.runtime.link import HEADER, EngineLink, decode_event, frame
from pdmesh.shared.runtime.loop import (
    AsyncRequestStream,
    Draining,
    LoopLoad,
    RequestStream,
    SessionSink,
    SessionStream,
    StreamEvent,
)


@dataclass
class EdgeConfig:
    role: str
    host: str
    port: int
    model_name: str
    otlp_endpoint: str | None = None
    log_level: str = "info"
    log_format: str = "text"
    fd: int = -1


def start_edge(module: str, config: EdgeConfig) -> tuple[subprocess.Popen, EngineLink]:
    """Spawn ``python -m module`` as this engine's edge; returns at once (the edge
    imports and binds while the engine loads), ``edge_port`` waits for its port."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    config.fd = theirs.fileno()
    proc = subprocess.Popen([sys.executable, "-m", module, json.dumps(config.__dict__)],
                            pass_fds=(theirs.fileno(),), preexec_fn=die_with_parent)
    theirs.close()
    return proc, EngineLink(ours)


def edge_port(proc: subprocess.Popen, link: EngineLink, timeout_s: float = 60.0) -> int:
    """The port the edge bound, once it serves; ValueError with the edge's message if
    it could not serve what the flags asked, RuntimeError if it died."""
    message = link.receive_one(timeout_s)
    if message and message[0] == "port":
        return int(message[1])
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if message and message[0] == "error":  # it could not serve what the flags asked
        raise ValueError(message[1])
    raise RuntimeError(f"the gRPC edge process did not start (exit status "
                       f"{proc.returncode}; its error is above)")


def stop_edge(proc: subprocess.Popen, link: EngineLink) -> None:
    """After the engine loop returned: closing the link ends the edge."""
    link.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class RemoteEngineLoop:
    """What the servicers use of an EngineLoop (submit, abort, load, draining,
    max_model_len), for the engine at the other end of the link. Refusals the engine
    makes (queue full, draining, an invalid request) come back as the request's first
    event, with ``error_code``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader = reader
        self._writer = writer
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._load = LoopLoad(0, 0, 0, 0, 0, 0)
        self._draining = False
        self._closed = False
        self._load_waiters: list[asyncio.Future] = []
        self.max_model_len = 0

    @property
    def draining(self) -> bool:
        return self._draining or self._closed

    def load(self) -> LoopLoad:
        return self._load

    async def refresh(self, timeout_s: float = 5.0) -> None:
        """Ask the engine for its load and draining state now (it answers between
        steps); after ``timeout_s`` the last ones it sent stand."""
        if self._closed:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._load_waiters.append(waiter)
        self._writer.write(frame(("load?",)))
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError:
            pass

    def submit(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
               priority: int = 0, output_token_ids: list[int] | None = None,
               aio_loop: asyncio.AbstractEventLoop | None = None,
               sink: SessionSink | None = None) -> RequestStream:
        if self._closed:
            raise Draining("the engine process is gone")
        rid = request_id or f"edge-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request_id: {rid!r} is already in flight")
        if sink is not None:
            stream: RequestStream = SessionStream(rid, sink)
        else:
            stream = AsyncRequestStream(rid, aio_loop or asyncio.get_running_loop())
        self._streams[rid] = stream
        self._writer.write(frame(("add", rid, prompt, params, priority, output_token_ids)))
        return stream

    def abort(self, request_id: str) -> None:
        # the engine answers with the request's last event (which drops the stream here)
        if request_id in self._streams and not self._closed:
            self._writer.write(frame(("abort", request_id)))

    async def run(self) -> None:
        """Read the engine's messages until the link closes; then every open stream
        ends with an error (its client continues elsewhere)."""
        try:
            while True:
                header = await self._reader.readexactly(HEADER.size)
                body = await self._reader.readexactly(HEADER.unpack(header)[0])
                self._handle(pickle.loads(body))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._closed = True
            self._wake_load_waiters()
            streams, self._streams = self._streams, {}
            for stream in streams.values():
                _put(stream, StreamEvent([], finished=True,
                                         error="the engine process exited"))

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "events":
            for item in message[1]:
                rid, event = decode_event(item)
                stream = (self._streams.pop(rid, None) if event.finished
                          else self._streams.get(rid))
                if stream is not None:
                    _put(stream, event)
        elif kind == "load":
            _, load, self._draining, self.max_model_len = message
            self._load = LoopLoad(**load)
            self._wake_load_waiters()

    def _wake_load_waiters(self) -> None:
        waiters, self._load_waiters = self._load_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


def _put(stream: RequestStream, event: StreamEvent) -> None:
    stream.put_local(event)  # type: ignore[attr-defined]  (streams of this event loop)


def serve_edge(add_servicer: Callable[..., None]) -> int:
    """The edge process's main: ``add_servicer(server, remote_loop, config)``."""
    from pdmesh.shared.infra.logs import setup_logging

    config = EdgeConfig(**json.loads(sys.argv[1]))
    setup_logging(config.log_level, config.log_format)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the engine drains, then closes the link
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return asyncio.run(_serve(config, add_servicer))


async def _serve(config: EdgeConfig, add_servicer: Callable[..., None]) -> int:
    import grpc

    sock = socket.socket(fileno=config.fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    remote = RemoteEngineLoop(reader, writer)
    server = grpc.aio.server()
    add_servicer(server, remote, config)
    try:
        port = server.add_insecure_port(f"{config.host}:{config.port}")
    except RuntimeError as e:  # the engine process reports it (and exits with it)
        writer.write(frame(("error", f"--port: cannot listen on {config.host}:"
                                     f"{config.port} ({e})")))
        await writer.drain()
        return 2
    await server.start()
    writer.write(frame(("port", port)))
    await remote.run()  # until the engine closes the link
    await server.stop(grace=1)
    return 0
