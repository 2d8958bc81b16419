"""One service's life, the same for all five (gateway, prefill, decode, kvstore, eplb).

    with ServiceHost(HostSettings(...)) as host:     signals caught from here on
        port = host.grpc_server(add)                  or aio_grpc_server / http_socket /
                                                      adopt_port (an engine's edge bound it)
        host.serve_metrics(collect)                   /metrics on --metrics-port
        host.register(load=...)                       registry entry + heartbeat
        host.ready(model=...)                         "<role> ready: {json}" on stdout
        host.wait()                                   or the service's own main loop
    (leaving: deregistered, servers stopped, metrics closed - whatever happened)

Every listener binds exactly ``settings.host``; a port that cannot be bound is a
ValueError naming ``--port`` (the command exits 2 with it). SIGTERM / SIGINT: the first
calls ``on_signal(1)`` (engines start draining; other services stop), a second
``on_signal(2)``. Handlers only set flags (``shared.infra.signals``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pdmesh.shared.infra import tls
from pdmesh.shared.infra.registry import Heartbeat, Instance, Registry
from pdmesh.shared.infra.signals import SignalStop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostSettings:
    role: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free one
    advertise_host: str | None = None  # where others reach it (default: host, or hostname)
    redis_url: str = "redis://127.0.0.1:6379/0"
    registry_prefix: str = "pdmesh"
    metrics_port: int = -1  # 0: any free one, -1: none
    model_name: str = ""
    metrics_names: str = "pdmesh"  # or "vllm": the families as vllm:X (--metrics-names)

    @property
    def reach(self) -> str:
        """The host others reach this service at."""
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", ""):
            return socket.gethostname()
        return self.host


class ServiceHost:
    def __init__(self, settings: HostSettings):
        self.settings = settings
        self.id = Heartbeat.new_id(settings.role)  # its registry id (and metrics label)
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.instance: Instance | None = None
        self.on_signal: Callable[[int], None] | None = None  # flags only (signal handler)
        self.aio_loop: asyncio.AbstractEventLoop | None = None  # aio_grpc_server's
        self.signals = SignalStop(on_signal=self._signalled).install()
        self._heartbeat: Heartbeat | None = None
        self._closers: list[Callable[[], None]] = []

    def __enter__(self) -> ServiceHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def address(self) -> str:
        return f"{self.settings.reach}:{self.port}"

    def _signalled(self, count: int) -> None:
        if self.on_signal is not None:
            self.on_signal(count)

    # -- listeners -----------------------------------------------------------------------
    def grpc_server(self, add: Callable[[Any], None], max_workers: int = 8) -> int:
        """A threaded gRPC server with ``add(server)``'s servicers, bound and started."""
        from concurrent import futures

        import grpc

        from pdmesh.shared.infra import cluster_auth

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                             interceptors=cluster_auth.server_interceptors())
        add(server)
        self.port = self._bind(lambda address: tls.add_port(server, address))
        server.start()
        self._closers.append(lambda: server.stop(grace=2).wait())
        return self.port

    def aio_grpc_server(self, add: Callable[[Any, asyncio.AbstractEventLoop], None],
                        options: list[tuple[str, Any]] | None = None) -> int:
        """A grpc.aio server on an event loop of its own thread; ``add(server, loop)``
        adds its servicers (on that loop)."""
        import grpc

        aio = asyncio.new_event_loop()
        threading.Thread(target=aio.run_forever, name="grpc-aio", daemon=True).start()

        from pdmesh.shared.infra import cluster_auth

        async def start() -> tuple[Any, int]:
            server = grpc.aio.server(options=options,
                                     interceptors=cluster_auth.aio_server_interceptors())
            add(server, aio)
            port = self._bind(lambda address: tls.add_port(server, address))
            await server.start()
            return server, port

        try:
            server, self.port = asyncio.run_coroutine_threadsafe(start(), aio).result(30)
        except BaseException:
            aio.call_soon_threadsafe(aio.stop)
            raise

        def stop() -> None:
            asyncio.run_coroutine_threadsafe(server.stop(grace=2), aio).result(10)
            aio.call_soon_threadsafe(aio.stop)

        self._closers.append(stop)
        self.aio_loop = aio
        return self.port

    def http_socket(self, backlog: int = 2048) -> socket.socket:
        """A listening TCP socket for an HTTP server. IPPROTO_TCP named explicitly:
        asyncio only sets TCP_NODELAY on sockets whose proto says TCP, and without it
        Nagle holds each SSE event behind the client's delayed ACK (~40 ms stalls)."""
        family = socket.AF_INET6 if ":" in self.settings.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((self.settings.host, self.settings.port))
        except OSError as e:
            sock.close()
            raise ValueError(f"--port: cannot listen on {self.settings.host}:"
                             f"{self.settings.port} ({e.strerror or e})") from e
        sock.listen(backlog)
        self.port = int(sock.getsockname()[1])
        self._closers.append(sock.close)
        return sock

    def at_close(self, close: Callable[[], None]) -> None:
        """Run ``close`` when the host closes (newest first, after deregistering)."""
        self._closers.append(close)

    def adopt_port(self, port: int) -> None:
        """The port another process of this service bound (an engine's gRPC edge)."""
        self.port = port

    def _bind(self, add_port: Callable[[str], int]) -> int:
        where = f"{self.settings.host}:{self.settings.port}"
        try:
            return int(add_port(_grpc_address(self.settings.host, self.settings.port)))
        except RuntimeError as e:  # grpc's "failed to bind"
            raise ValueError(f"--port: cannot listen on {where} ({e})") from e

    # -- metrics, registry, ready line ---------------------------------------------------
    def serve_metrics(self, collect: Callable[[], Iterator[Any]],
                      registry: Any = None) -> int | None:
        """/metrics on --metrics-port (None: -1, no metrics)."""
        if self.settings.metrics_port < 0:
            return None
        from pdmesh.shared.infra.metrics import serve_metrics

        self.metrics_port, close = serve_metrics(collect, self.settings.host,
                                                 self.settings.metrics_port, registry,
                                                 self.settings.metrics_names)
        self._closers.append(close)
        return self.metrics_port

    @property
    def metrics_url(self) -> str | None:
        if self.metrics_port is None:
            return None
        return f"http://{self.settings.reach}:{self.metrics_port}/metrics"

    def register(self, load: Callable[[], dict[str, int]] | None = None,
                 adapters: Callable[[], list[str]] | None = None,
                 **fields: Any) -> Instance:
        """Register in the registry and heartbeat from now on (``fields``: the
        Instance's dp_size, dp_rank, group; ``adapters``: the LoRA adapters it holds)."""
        s = self.settings
        self.instance = Instance(self.id, s.role, self.address,
                                 s.model_name, **fields)
        self._heartbeat = Heartbeat(Registry(s.redis_url, s.registry_prefix), self.instance,
                                    load=load, adapters=adapters)
        self._heartbeat.start()
        return self.instance

    def mark_draining(self) -> None:
        """Tell the registry at once (from a thread: it talks to redis)."""
        if self._heartbeat is not None:
            threading.Thread(target=self._heartbeat.mark_draining, daemon=True).start()

    def ready(self, **info: Any) -> None:
        """The line a launcher waits for: "<role> ready: {json}"."""
        head: dict[str, Any] = {}
        if self.port is not None:
            head = ({"http": f"http://{self.address}"} if self.settings.role == "gateway"
                    else {"grpc": self.address})
        if self.instance is not None:
            head["id"] = self.instance.id
        head["metrics"] = self.metrics_url
        print(f"{self.settings.role} ready: " + json.dumps({**head, **info}), flush=True)

    def wait(self) -> None:
        """Until SIGTERM / SIGINT."""
        self.signals.wait()

    def close(self) -> None:
        """Deregister, then stop what was started (newest first). Safe to call twice."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        closers, self._closers = self._closers, []
        for close in reversed(closers):
            try:
                close()
            except Exception:  # noqa: BLE001 (stopping the rest matters more)
                log.exception("stopping %s", self.settings.role)


def _grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
