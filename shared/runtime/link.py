"""The engine's port when its gRPC edge runs in a process of its own (vLLM's API-server /
engine-core split): one unix socket pair, framed engine-protocol messages.

    edge process (grpc.aio)  ── SubmitRequest / AbortRequest / LoadQuery ──▶  engine
                             ◀── StepOutputs (one per step) / EngineLoad ───

The engine side (``SocketPort``) is polled between steps and never waits on the edge
except to write; the edge writes through asyncio (buffered, never blocking), so the two
can never both wait on a full socket.
"""

from __future__ import annotations

import select
import socket

from pdmesh.shared.runtime.protocol import (
    EngineLoad,
    FrameReader,
    StepOutputs,
    ToEngine,
    TokenDelta,
    encode,
)


class SocketPort:
    """The engine process's end of the socket pair (an ``EnginePort``)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.closed = False
        self._reader = FrameReader(ToEngine)
        self._backlog: list[ToEngine] = []  # read by receive_one, not yet returned

    def receive(self) -> list[ToEngine]:
        messages, self._backlog = self._backlog, []
        while not self.closed:
            try:
                data = self.sock.recv(1 << 18, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                self.closed = True
                break
            messages += self._reader.feed(data)
        return messages

    def receive_one(self, timeout_s: float) -> ToEngine | None:
        """Block for the next message (the start-up handshake); None if the edge closed
        its end or said nothing in time."""
        ready, _, _ = select.select([self.sock], [], [], timeout_s)
        while ready:
            got = self.receive()
            if got:
                self._backlog = got[1:]
                return got[0]
            if self.closed:
                return None
            ready, _, _ = select.select([self.sock], [], [], timeout_s)
        return None

    def wait(self, timeout_s: float) -> bool:
        if self.closed:
            return False
        return bool(self._backlog or select.select([self.sock], [], [], timeout_s)[0])

    def send(self, deltas: list[TokenDelta]) -> None:
        if deltas:
            self._write(StepOutputs(deltas))

    def publish(self, load: EngineLoad) -> None:
        self._write(load)

    def _write(self, message: StepOutputs | EngineLoad) -> None:
        if self.closed:
            return
        try:
            self.sock.sendall(encode(message))
        except OSError:
            self.closed = True

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
