"""An EngineLoop on a thread, driven synchronously through a LocalPort: what the
in-process client does, minus the event loop, so tests can read deltas with a timeout."""

from __future__ import annotations

import itertools
import queue
import threading

from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.runtime.loop import EngineLoop, LocalPort
from pdmesh.shared.runtime.protocol import AbortRequest, SubmitRequest, TokenDelta


class Stream:
    def __init__(self, request_id: str):
        self.request_id = request_id
        self.deltas: queue.Queue[TokenDelta] = queue.Queue()

    def get(self, timeout: float = 30) -> TokenDelta:
        return self.deltas.get(timeout=timeout)

    def drain(self, timeout: float = 30) -> tuple[list[int], TokenDelta]:
        """Every token until the finished delta, and that delta."""
        tokens, last = [], None
        while last is None or not last.finished:
            last = self.get(timeout)
            tokens += last.token_ids
        return tokens, last


class LoopDriver:
    def __init__(self, engine, start: bool = True):
        self.port = LocalPort()
        self.port.on_deltas = self._deliver
        self.loop = EngineLoop(engine, self.port)
        self.engine = engine
        self._streams: dict[str, Stream] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self.loop.run, daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        self._thread.start()

    def submit(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
               priority: int | None = None,
               output_token_ids: list[int] | None = None) -> Stream:
        rid = request_id or f"t-{next(self._ids)}"
        stream = Stream(rid)
        self._streams.setdefault(rid, stream)
        if self._streams[rid] is not stream:  # a duplicate id: its deltas come here too
            stream = self._streams[rid]
        self.port.put(SubmitRequest(rid, prompt, params, priority, output_token_ids or []))
        return stream

    def abort(self, request_id: str) -> None:
        self.port.put(AbortRequest(request_id))

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        for d in deltas:
            self._streams[d.request_id].deltas.put(d)

    def stop(self) -> None:
        self.loop.stop()
        if self._thread.is_alive():
            self._thread.join(10)
