"""How a service's gRPC edge reaches its engine: one ``EngineClient`` interface, two
implementations, the same for prefill and decode.

    servicer ──submit(SubmitRequest, sink)──▶ EngineClient ──▶ the engine's port
    servicer ◀──sink.push(TokenDelta)──────── (on the edge's event loop)

``InProcessEngineClient``: the engine steps in another thread of this process (a
``LocalPort``). ``RemoteEngineClient``: the engine steps in the process that started
this edge process, at the other end of a socket pair (a ``SocketPort``). Either way the
servicer sees the same thing: every submitted request's deltas arrive at its sink, on
the event loop's thread, ending with one finished delta - a refusal (invalid, queue
full, draining) included, so refusals are handled in one place. Nothing here imports
torch.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Protocol

import msgspec

from pdmesh.shared.runtime.loop import LocalPort
from pdmesh.shared.runtime.protocol import (
    HEADER,
    AbortRequest,
    Draining,
    EngineLoad,
    FrameReader,
    FromEngine,
    InvalidRequest,
    LoadQuery,
    LoraCommand,
    StepOutputs,
    SubmitRequest,
    ToEngine,
    TokenDelta,
    encode,
    refused,
)

LOAD_FRESH_MS = 1000  # an engine that steps publishes its load every 0.1 s


class DeltaSink(Protocol):
    def push(self, delta: TokenDelta) -> None:
        """A request's next delta, on the event loop's own thread."""


class RequestStream:
    """One request's deltas, read with ``await next()``."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[TokenDelta] = asyncio.Queue()

    def push(self, delta: TokenDelta) -> None:
        self._queue.put_nowait(delta)

    async def next(self) -> TokenDelta:
        """The next delta merged with any already waiting."""
        delta = await self._queue.get()
        while not delta.finished and not self._queue.empty():
            delta = delta.then(self._queue.get_nowait())
        return delta


class SessionSink:
    """Where many requests' deltas meet: a step's deltas for all of a session's requests
    come out of ``take`` together (one gRPC message per step, not one per request)."""

    def __init__(self) -> None:
        self.ready = asyncio.Event()
        self._pending: list[TokenDelta] = []

    def push(self, delta: TokenDelta) -> None:
        self._pending.append(delta)
        self.ready.set()

    def take(self) -> list[TokenDelta]:
        """What arrived, one delta per request (steps that piled up merge)."""
        items, self._pending = self._pending, []
        self.ready.clear()
        merged: dict[str, TokenDelta] = {}
        for d in items:
            prev = merged.get(d.request_id)
            merged[d.request_id] = d if prev is None or prev.finished else prev.then(d)
        return list(merged.values())


class EngineClient(Protocol):
    """An engine, as its gRPC edge uses it. Call it from the edge's event loop."""

    @property
    def draining(self) -> bool: ...

    @property
    def max_model_len(self) -> int: ...

    def load(self) -> EngineLoad:
        """The load the engine published last (at most 0.1 s old while it steps)."""

    async def refresh(self, timeout_s: float = 5.0) -> None:
        """Ask the engine for its load and state now; after ``timeout_s`` the last ones
        stand."""

    def submit(self, request: SubmitRequest, sink: DeltaSink) -> None:
        """Send a request; its deltas go to ``sink``. Never raises for a refusal: that
        arrives as the request's only delta, with ``error``."""

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; its last delta says "abort"."""

    async def lora(self, command: LoraCommand, timeout_s: float) -> TokenDelta:
        """Load or unload a LoRA adapter; the answer's ``error`` says why not."""


class _ClientCore:
    """What both clients share: the sinks of requests in flight, the last load, and the
    refusals a client can make without asking the engine."""

    def __init__(self) -> None:
        self._sinks: dict[str, DeltaSink] = {}
        self._load = EngineLoad()
        self._load_at = time.monotonic()
        self._load_waiters: list[asyncio.Future[None]] = []
        self._closed = False

    @property
    def draining(self) -> bool:
        return self._closed or self._load.draining

    @property
    def max_model_len(self) -> int:
        return self._load.max_model_len

    def load(self) -> EngineLoad:
        """The last load, its stall grown by its age when it showed work: an engine
        stuck inside a step publishes nothing, and answers no load query."""
        load = self._load
        if load.running or load.waiting:
            age_ms = int((time.monotonic() - self._load_at) * 1000)
            if age_ms > LOAD_FRESH_MS:
                return msgspec.structs.replace(load, stalled_ms=load.stalled_ms + age_ms)
        return load

    async def refresh(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._load_waiters.append(waiter)
        self._send(LoadQuery())
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError:
            pass

    def submit(self, request: SubmitRequest, sink: DeltaSink) -> None:
        rid = request.request_id
        if self.draining:
            gone = "the engine is gone" if self._closed else "this instance is draining"
            sink.push(refused(rid, Draining(f"{gone}; use another instance")))
        elif rid in self._sinks:
            sink.push(refused(rid, InvalidRequest(f"request_id: {rid!r} is already in "
                                                  "flight")))
        else:
            self._sinks[rid] = sink
            self._send(request)

    def abort(self, request_id: str) -> None:
        # the engine answers with the request's last delta, which drops its sink here
        if request_id in self._sinks and not self._closed:
            self._send(AbortRequest(request_id))

    async def lora(self, command: LoraCommand, timeout_s: float) -> TokenDelta:
        command.token = f"lora-{uuid.uuid4().hex}"  # (answered as a request of its own)
        stream = RequestStream()
        if self.draining:
            return refused(command.token, Draining("this instance is draining"))
        self._sinks[command.token] = stream
        self._send(command)
        try:
            async with asyncio.timeout(timeout_s):
                return await stream.next()
        except TimeoutError:
            self._sinks.pop(command.token, None)
            return refused(command.token, Draining(
                f"the engine did not answer within {timeout_s:g} s"))

    def _send(self, message: ToEngine) -> None:
        raise NotImplementedError

    def _on_deltas(self, deltas: list[TokenDelta]) -> None:
        for d in deltas:
            sink = (self._sinks.pop(d.request_id, None) if d.finished
                    else self._sinks.get(d.request_id))
            if sink is not None:
                sink.push(d)

    def _on_load(self, load: EngineLoad) -> None:
        self._load = load
        self._load_at = time.monotonic()
        self._wake_load_waiters()

    def _on_closed(self, why: str) -> None:
        """The engine went away: every request in flight ends with UNAVAILABLE."""
        self._closed = True
        self._wake_load_waiters()
        sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            sink.push(refused(rid, Draining(why)))

    def _wake_load_waiters(self) -> None:
        waiters, self._load_waiters = self._load_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class InProcessEngineClient(_ClientCore):
    """The engine steps in another thread of this process; its deltas hop onto this
    event loop once per step (one call_soon_threadsafe, not one per request)."""

    def __init__(self, port: LocalPort, aio_loop: asyncio.AbstractEventLoop):
        super().__init__()
        self._port = port
        port.on_deltas = lambda deltas: aio_loop.call_soon_threadsafe(self._on_deltas, deltas)
        port.on_load = lambda load: aio_loop.call_soon_threadsafe(self._on_load, load)

    def _send(self, message: ToEngine) -> None:
        self._port.put(message)

    def close(self) -> None:
        self._on_closed("the engine stopped")


class RemoteEngineClient(_ClientCore):
    """The engine steps in another process, at the other end of ``reader``/``writer``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        super().__init__()
        self._reader = reader
        self._writer = writer
        self._frames = FrameReader(FromEngine)

    def _send(self, message: ToEngine) -> None:
        self._writer.write(encode(message))

    async def run(self) -> None:
        """Read the engine's messages until the link closes; then every open request
        ends with an error (its caller continues elsewhere)."""
        try:
            while True:
                header = await self._reader.readexactly(HEADER.size)
                body = await self._reader.readexactly(HEADER.unpack(header)[0])
                message = self._frames.decode_one(body)
                if isinstance(message, StepOutputs):
                    self._on_deltas(message.deltas)
                else:
                    self._on_load(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._on_closed("the engine process exited")
