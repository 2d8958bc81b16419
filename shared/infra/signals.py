"""Stopping on SIGTERM / SIGINT without taking locks in a signal handler.

Python runs a signal handler in the main thread between two bytecodes of whatever that
thread was doing. A handler that calls ``threading.Event.set`` (or starts a thread)
takes a lock the interrupted code may already hold: the main thread waiting in
``Event.wait`` holds its condition's lock between waits, and the handler then blocks on
it forever - a process that ignores every later signal and leaves its children running.
So handlers here only count signals and write one byte to a pipe; the main thread waits
on the pipe with select().
"""

from __future__ import annotations

import os
import select
import signal
from collections.abc import Callable


class SignalStop:
    """``wait`` until SIGTERM / SIGINT (installed by ``install``); ``count`` says how many
    arrived. ``on_signal(count)`` runs in the handler: it must only set plain attributes."""

    def __init__(self, on_signal: Callable[[int], None] | None = None):
        self.count = 0
        self._on_signal = on_signal
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        os.set_blocking(self._r, False)

    def install(self) -> SignalStop:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.count += 1
        try:
            os.write(self._w, b"x")
        except BlockingIOError:  # the pipe is full of earlier wake-ups: awake already
            pass
        if self._on_signal is not None:
            self._on_signal(self.count)

    def is_set(self) -> bool:
        return self.count > 0

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until a signal arrived (True) or ``timeout_s`` passed (False)."""
        if not self.count:
            select.select([self._r], [], [], timeout_s)
            try:
                os.read(self._r, 4096)
            except BlockingIOError:
                pass
        return self.count > 0
