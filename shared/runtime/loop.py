"""An engine stepping in its own thread, fed by many callers.

    caller threads ──submit()──▶ inbox ──▶ loop (main thread): add / abort, step(), dispatch
          ▲                                                       │
          └──────────── RequestStream (one queue per request) ◀───┘

Validation happens in ``submit`` on the caller's thread, so a bad request raises
ValueError there and never reaches the loop; with ``max_queued_requests`` a request
arriving while that many wait raises QueueFull there too (admission control: no
unbounded queue). A finished stream always ends with an event whose ``finished`` is
set; an engine failure ends every stream with ``error``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdmesh.shared.engine.request import Logprob, Request, RequestStatus
from pdmesh.shared.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # (the gRPC edge processes import this module without torch)
    from pdmesh.shared.engine.engine import EngineCore, StepOutput

log = logging.getLogger(__name__)


class Draining(Exception):
    """A request refused because the instance is draining (shutting down gracefully):
    the caller should go to another instance (gRPC UNAVAILABLE)."""


class QueueFull(Exception):
    """A request refused at submission: ``limit`` requests already wait (not yet running)
    on this instance. The caller may retry later or elsewhere (gRPC RESOURCE_EXHAUSTED,
    HTTP 429); it is not the request's fault, so not a ValueError."""

    def __init__(self, limit: int):
        super().__init__(f"max_queued_requests: {limit} requests already wait on this "
                         f"instance (the limit); retry later or on another instance")
        self.limit = limit


@dataclass
class StreamEvent:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    kv_keys: list[str] = field(default_factory=list)
    error: str | None = None
    timing: dict[str, object] | None = None  # the request's timestamps, when finished
    # why a request was refused, as a gRPC status name (RESOURCE_EXHAUSTED, UNAVAILABLE,
    # INVALID_ARGUMENT), when that is known only after submission (engine in another
    # process); None: the engine failed (UNAVAILABLE)
    error_code: str | None = None

    def then(self, more: StreamEvent) -> StreamEvent:
        """This event followed by ``more`` of the same request, as one event (readers
        that fell behind get the steps they missed together)."""
        return StreamEvent(self.token_ids + more.token_ids, self.logprobs + more.logprobs,
                           more.finished, more.finish_reason, more.stop_reason,
                           self.num_cached_tokens, more.kv_keys or self.kv_keys, more.error,
                           more.timing, more.error_code)


class RequestStream:
    """What one request produced, event by event."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._events: queue.Queue[StreamEvent] = queue.Queue()

    def get(self, timeout: float | None = None) -> StreamEvent:
        return self._events.get(timeout=timeout)

    def put(self, event: StreamEvent) -> None:
        self._events.put(event)


class AsyncRequestStream(RequestStream):
    """The same, read from an asyncio event loop (one thread serves every request)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        super().__init__(request_id)
        self.loop = loop
        self._aq: asyncio.Queue[StreamEvent] = asyncio.Queue()

    def put(self, event: StreamEvent) -> None:
        self.loop.call_soon_threadsafe(self._aq.put_nowait, event)

    def put_local(self, event: StreamEvent) -> None:
        """From the event loop's own thread."""
        self._aq.put_nowait(event)

    async def next(self) -> StreamEvent:
        """The next event merged with any already waiting."""
        event = await self._aq.get()
        while not event.finished and not self._aq.empty():
            event = event.then(self._aq.get_nowait())
        return event


class SessionSink:
    """Where many requests' events meet, on an asyncio event loop: a step's events for
    all of the session's requests come out of ``take`` together (one gRPC message per
    step, not one per token per request)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.ready = asyncio.Event()
        self._pending: list[tuple[str, StreamEvent]] = []

    def push(self, request_id: str, event: StreamEvent) -> None:
        """From the event loop's own thread."""
        self._pending.append((request_id, event))
        self.ready.set()

    def take(self) -> list[tuple[str, StreamEvent]]:
        items, self._pending = self._pending, []
        self.ready.clear()
        return items


class LinkStream(RequestStream):
    """A request submitted by the gRPC edge process: its events go back over the link,
    all of one step in one message."""

    def __init__(self, request_id: str, link):
        super().__init__(request_id)
        self.link = link

    def put(self, event: StreamEvent) -> None:
        self.link.put(self.request_id, event)


class SessionStream(AsyncRequestStream):
    """A request whose events go to a SessionSink instead of a queue of its own."""

    def __init__(self, request_id: str, sink: SessionSink):
        RequestStream.__init__(self, request_id)
        self.loop = sink.loop
        self.sink = sink

    def put(self, event: StreamEvent) -> None:
        self.loop.call_soon_threadsafe(self.sink.push, self.request_id, event)

    def put_local(self, event: StreamEvent) -> None:
        self.sink.push(self.request_id, event)

    async def next(self) -> StreamEvent:
        raise TypeError("a session stream is read through its SessionSink")


@dataclass
class LoopLoad:
    running: int
    waiting: int
    free_kv_blocks: int
    total_kv_blocks: int
    queued_prefill_tokens: int  # prompt tokens admitted or waiting, not yet computed
    block_size: int  # tokens per KV block (routers estimate prefix-cache hits with it)
    placement_version: int = 0  # the EPLB expert placement this rank runs
    expert_bytes_moved: int = 0  # expert weights this rank received in placement changes


class EngineLoop:
    def __init__(self, engine: EngineCore, eplb=None):
        """``eplb``: a RankEplb (expert-parallel ranks with dynamic EPLB)."""
        self.engine = engine
        self.eplb = eplb
        self.on_finished = None  # called with each finished Request (metrics)
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[RequestStream, Request | None]] = {}
        self._drain_deadline: float | None = None  # set by ``drain``
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._link = None  # an EngineLink: requests come from a gRPC edge process
        self._load_sent = 0.0
        self._drain_told = False
        self._stopping = False  # set by stop() or a second drain(): return now
        self.on_drain = None  # called once, from the loop, when draining starts

    def attach_link(self, link) -> None:
        """Serve the requests of a gRPC edge process (pdmesh.shared.runtime.link) from now on."""
        self._link = link
        self._send_load(force=True)

    def run(self) -> None:
        """Step in the calling thread until ``stop``. Call it from the main thread: torch's
        OpenMP kernels ran ~3x slower when stepping from a helper thread."""
        self._run()

    def stop(self) -> None:
        """Ask ``run`` to return (after failing every stream still open)."""
        self._stopping = True
        self._wake.set()

    def drain(self, timeout_s: float) -> None:
        """Refuse new requests (Draining) and let ``run`` return once every request in
        flight has finished, or after ``timeout_s`` (what is left then fails, and callers
        continue it elsewhere). A second call stops at once."""
        # Called from signal handlers: plain assignments only, no locks, no wake-up
        # (pdmesh.shared.infra.signals); the loop notices within its idle wait.
        if self._drain_deadline is not None:
            self._stopping = True
            return
        self._drain_deadline = time.monotonic() + timeout_s

    async def refresh(self) -> None:
        """Load and draining are read here directly (an engine in another process is
        asked first: pdmesh.shared.runtime.edge.RemoteEngineLoop.refresh)."""

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def _should_stop(self) -> bool:
        if self._stopping:
            return True
        if self._drain_deadline is None:
            return False
        with self._lock:
            idle = not self._streams
        return idle or time.monotonic() >= self._drain_deadline

    def load(self) -> LoopLoad:
        s = self.engine.scheduler
        queued = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens)
                     for r in (*s.running, *s.waiting))
        ep = self.engine.ep
        return LoopLoad(len(s.running), len(s.waiting), self.engine.kv.num_free_blocks,
                        self.engine.kv.num_blocks, queued, self.engine.config.block_size,
                        ep.version if ep is not None else 0,
                        ep.bytes_moved if ep is not None else 0)

    def submit(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
               priority: int = 0, output_token_ids: list[int] | None = None,
               aio_loop: asyncio.AbstractEventLoop | None = None,
               sink: SessionSink | None = None, link=None) -> RequestStream:
        """Queue a request (ValueError, naming the field, if it is invalid; QueueFull if
        ``max_queued_requests`` already wait). With ``aio_loop`` the stream is an
        AsyncRequestStream read on that event loop; with ``sink`` its events go to that
        session; with ``link`` they go back to the edge process."""
        if self._drain_deadline is not None:
            raise Draining("this instance is draining (shutting down); use another")
        self.engine.validate_request(prompt, params, output_token_ids)
        rid = request_id or f"loop-{next(self._ids)}"
        if link is not None:
            stream: RequestStream = LinkStream(rid, link)
        elif sink is not None:
            stream = SessionStream(rid, sink)
        elif aio_loop is not None:
            stream = AsyncRequestStream(rid, aio_loop)
        else:
            stream = RequestStream(rid)
        limit = self.engine.config.max_queued_requests
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request_id: {rid!r} is already in flight")
            if limit is not None and self._num_waiting() >= limit:
                raise QueueFull(limit)
            self._streams[rid] = (stream, None)
        self._inbox.put(("add", (rid, prompt, params, priority, output_token_ids)))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def _num_waiting(self) -> int:
        """Requests submitted and not yet running: still in the inbox, or in the waiting
        queue (preempted ones included). Under ``self._lock``."""
        return sum(1 for _, req in self._streams.values()
                   if req is None or req.status is RequestStatus.WAITING)

    # -- the loop thread --------------------------------------------------------------
    def _run(self) -> None:
        if self.engine.ep is not None:
            self._run_lockstep()
            return
        while not self._should_stop():
            self._notice_drain()
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._idle(0.05)
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 (the loop must outlive any one step)
                log.exception("engine step failed")
                self._fail_all(f"engine step failed: {e}")
                continue
            self._dispatch_step(outputs)
        self._fail_all("engine stopped")

    def _run_lockstep(self) -> None:
        """Expert-parallel ranks: every rank steps when any rank has work (an idle rank's
        step serves the others' tokens), and all stop together."""
        import torch
        import torch.distributed as dist

        # [any work, stop, newest placement version, -oldest placement version, then per
        # rank: active KV blocks, long request seen, smallest active request] - each
        # rank fills its own slots, so
        # the MAX all-reduce doubles as the all-gather DyntraLB needs (one collective)
        world = dist.get_world_size()
        rank = dist.get_rank()
        lb = self.engine.dyntralb
        flags = torch.zeros(4 + 3 * world, dtype=torch.int64)
        while True:
            self._notice_drain()
            self._drain_inbox()
            version = self.eplb.known_version() if self.eplb is not None else 0
            flags.zero_()
            flags[0] = int(self.engine.has_unfinished())
            flags[1] = -int(self._should_stop())  # MAX of -stop: every rank wants to stop
            flags[2], flags[3] = version, -version
            if lb is not None:
                active, long_seen, floor = lb.local_summary(self.engine.scheduler)
                flags[4 + rank] = active
                flags[4 + world + rank] = long_seen
                flags[4 + 2 * world + rank] = floor
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            if flags[1] < 0:  # ranks stop together, once all are done (or told to)
                break
            if self.eplb is not None:
                self.eplb.at_step_boundary(int(flags[2]), -int(flags[3]))
            if not flags[0]:
                self._idle(0.005)
                continue
            if lb is not None:  # counts engine steps, not idle turns
                lb.on_step(self.engine.scheduler, flags[4:4 + world].tolist(),
                           bool(flags[4 + world:4 + 2 * world].any()),
                           flags[4 + 2 * world:].tolist())
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001
                log.exception("engine step failed")
                self._fail_all(f"engine step failed: {e}")
                continue
            self._dispatch_step(outputs)
        self._fail_all("engine stopped")

    def _notice_drain(self) -> None:
        if self._drain_deadline is not None and not self._drain_told:
            self._drain_told = True
            if self._link is not None:
                self._send_load(force=True)
            if self.on_drain is not None:
                self.on_drain()

    def _idle(self, timeout_s: float) -> None:
        if self._link is not None:
            self._send_load()
            self._link.wait(timeout_s)  # a signal's drain() waits for the timeout
        else:
            self._wake.wait(timeout_s)
            self._wake.clear()

    def _send_load(self, force: bool = False) -> None:
        """The edge answers Health from this (at most every 0.1 s, and at once when
        draining starts)."""
        now = time.monotonic()
        if force or now - self._load_sent >= 0.1:
            self._load_sent = now
            self._link.send(("load", dataclasses.asdict(self.load()), self.draining,
                             self.max_model_len))

    def _poll_link(self) -> None:
        link = self._link
        for message in link.receive():
            if message[0] == "add":
                _, rid, prompt, params, priority, done = message
                try:
                    self.submit(prompt, params, request_id=rid, priority=priority,
                                output_token_ids=done, link=link)
                except (QueueFull, Draining, ValueError) as e:
                    code = ("RESOURCE_EXHAUSTED" if isinstance(e, QueueFull) else
                            "UNAVAILABLE" if isinstance(e, Draining) else "INVALID_ARGUMENT")
                    link.put(rid, StreamEvent([], finished=True, error=str(e),
                                              error_code=code))
            elif message[0] == "abort":
                self._inbox.put(("abort", message[1]))
            elif message[0] == "load?":
                self._send_load(force=True)
        if link.closed and not self._stopping:
            log.error("the gRPC edge process went away; stopping")
            self._stopping = True

    def _dispatch_step(self, outputs: list[StepOutput]) -> None:
        """Hand a step's events to their readers; readers on an event loop get the whole
        step in one wake-up (one call_soon_threadsafe per loop, not one per request)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[AsyncRequestStream, StreamEvent]]]
        batches = {}
        for out in outputs:
            req = out.request
            with self._lock:
                entry = (self._streams.pop(req.request_id, None) if out.finished
                         else self._streams.get(req.request_id))
            if entry is None:
                continue
            if out.finished and self.on_finished is not None:
                self.on_finished(req)
            stream, tokens = entry[0], out.new_token_ids
            lps = (req.logprobs[-len(tokens):]
                   if tokens and req.sampling_params.logprobs is not None else [])
            event = StreamEvent(tokens, lps, out.finished, req.finish_reason, req.stop_reason,
                                max(req.num_cached_tokens, 0), list(req.kv_keys),
                                timing=req.timing() if out.finished else None)
            if isinstance(stream, AsyncRequestStream):
                batches.setdefault(stream.loop, []).append((stream, event))
            else:
                stream.put(event)
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_deliver, items)
        if self._link is not None:
            self._link.flush()
            self._send_load()

    def _drain_inbox(self) -> None:
        if self._link is not None:
            self._poll_link()
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                rid, prompt, params, priority, done = payload  # type: ignore[misc]
                try:
                    req = self.engine.add_request(prompt, params, request_id=rid,
                                                  priority=priority, output_token_ids=done)
                except ValueError as e:
                    self._finish_stream(rid, StreamEvent([], finished=True, error=str(e)))
                    continue
                with self._lock:
                    stream = self._streams[rid][0]
                    self._streams[rid] = (stream, req)
            elif kind == "abort":
                rid = payload  # type: ignore[assignment]
                self.engine.abort(rid)
                self._finish_stream(rid, StreamEvent([], finished=True, finish_reason="abort"))
        if self._link is not None:
            self._link.flush()

    def _finish_stream(self, rid: str, event: StreamEvent) -> None:
        with self._lock:
            entry = self._streams.pop(rid, None)
        if entry is not None:
            entry[0].put(event)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            pending = list(self._streams)
        for rid in pending:
            self.engine.abort(rid)
            self._finish_stream(rid, StreamEvent([], finished=True, error=message))
        if self._link is not None:
            self._link.flush()


def _deliver(items: list[tuple[AsyncRequestStream, StreamEvent]]) -> None:
    for stream, event in items:
        stream.put_local(event)
