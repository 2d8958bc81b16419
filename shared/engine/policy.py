"""Scheduling policies: which waiting request goes next, which running one yields.

A policy is an object the scheduler asks, never a branch inside the scheduler. Later
policies (short-request-first, DyntraLB) plug in here.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from shared.engine.request import Request


class SchedulingPolicy(ABC):
    """The waiting queue plus the preemption order."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """A new arrival."""

    @abstractmethod
    def readd(self, request: Request) -> None:
        """A preempted request coming back; it should run again before new arrivals."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request to admit (the queue is not empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return what ``peek`` returned."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Drop a waiting request (aborted)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    @abstractmethod
    def victim(self, running: list[Request]) -> Request:
        """The running request to preempt when blocks run out."""


class FCFSPolicy(SchedulingPolicy):
    """First come, first served; the latest admitted request is preempted first."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def readd(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def victim(self, running: list[Request]) -> Request:
        return running[-1]


class PriorityPolicy(SchedulingPolicy):
    """Lowest ``priority`` value first (vLLM's convention), then arrival order; the
    preempted request is the running one that would be scheduled last."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    @staticmethod
    def _key(r: Request) -> tuple[int, float]:
        return (r.priority, r.arrival_time)

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*self._key(request), next(self._seq), request))

    readd = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))

    def victim(self, running: list[Request]) -> Request:
        return max(running, key=self._key)


POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    if name not in POLICIES:
        raise ValueError(f"scheduling_policy: must be one of {', '.join(POLICIES)}, got {name!r}")
    return POLICIES[name]()
