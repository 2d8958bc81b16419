"""The wire between an engine process and its gRPC edge process (vLLM's API-server /
engine-core split): the edge decodes protobuf and keeps the streams, the engine steps
without sharing its interpreter (and its GIL) with gRPC.

    edge process (grpc.aio)  ── ("add", ...) / ("abort", id) ──▶  engine process
                             ◀── ("events", [...]) one per step, ("load", ...) ──

One unix socket pair; a frame is a 4-byte big-endian length, then a pickle. The engine
side (``EngineLink``) is polled between steps and never waits on the edge except to
write; the edge writes through asyncio (buffered, never blocking), so the two can never
both wait on a full socket.
"""

from __future__ import annotations

import pickle
import select
import socket
import struct
from typing import Any

from pdmesh.shared.runtime.loop import StreamEvent

HEADER = struct.Struct("!I")


def frame(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


class FrameReader:
    """Bytes in, whole messages out."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        out = []
        start = 0
        while len(self._buf) - start >= HEADER.size:
            (n,) = HEADER.unpack_from(self._buf, start)
            end = start + HEADER.size + n
            if len(self._buf) < end:
                break
            out.append(pickle.loads(memoryview(self._buf)[start + HEADER.size:end]))
            start = end
        del self._buf[:start]
        return out


def encode_event(request_id: str, event: StreamEvent) -> tuple:
    """A step's tokens for one request as a bare tuple (most events); anything more -
    finished, logprobs, an error - as the whole event."""
    if (event.finished or event.logprobs or event.error is not None
            or event.timing is not None or event.kv_keys):
        return (request_id, event)
    return (request_id, event.token_ids, event.num_cached_tokens)


def decode_event(item: tuple) -> tuple[str, StreamEvent]:
    if len(item) == 2:
        return item  # type: ignore[return-value]
    rid, tokens, cached = item
    return rid, StreamEvent(tokens, num_cached_tokens=cached)


class EngineLink:
    """The engine process's end: ``receive`` what the edge sent (never blocks), ``put``
    events and ``flush`` them as one message, ``wait`` while idle."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.closed = False
        self._reader = FrameReader()
        self._pending: list[tuple] = []
        self._backlog: list[Any] = []  # read by receive_one, not yet returned

    def receive(self) -> list[Any]:
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

    def receive_one(self, timeout_s: float) -> Any:
        """Block for the next message (start-up handshake); None if the edge closed its
        end or said nothing in time."""
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

    def wait(self, timeout_s: float) -> None:
        """Until the edge sends something, or ``timeout_s``."""
        if not self.closed:
            select.select([self.sock], [], [], timeout_s)

    def put(self, request_id: str, event: StreamEvent) -> None:
        self._pending.append(encode_event(request_id, event))

    def flush(self) -> None:
        if self._pending:
            items, self._pending = self._pending, []
            self.send(("events", items))

    def send(self, message: Any) -> None:
        if self.closed:
            return
        try:
            self.sock.sendall(frame(message))
        except OSError:
            self.closed = True

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
