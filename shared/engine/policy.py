"""Scheduling policies: which waiting request goes next, which running one yields.

A policy is an object the scheduler asks, never a branch inside the scheduler:

    fcfs                 arrival order
    priority             by the request's ``priority``, lower or larger values first
    short_request_first  vLLM-Ascend's ShortRequestFirst lanes (short prompts first)
    lpm, lof, random     SGLang's --schedule-policy: longest cached prefix first (with its
                         in-batch deprioritisation), longest output first, shuffled;
                         ordered again before each step's admission (``reorder``)
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator

from pdmesh.shared.engine.config import EngineConfig
from pdmesh.shared.engine.request import Request

log = logging.getLogger(__name__)


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

    def outranked(self, request: Request, running: list[Request]) -> list[Request]:
        """The running requests a waiting ``request`` that finds no seat or blocks may
        preempt, the first to go first (none: it waits its turn)."""
        return []


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
    """Lowest ``priority`` value first (vLLM's convention; with ``low_values_first``
    False the largest, SGLang's default), then arrival order; the preempted request is
    the running one that would be scheduled last.

    With ``preemption_threshold`` (SGLang's ``--priority-scheduling-preemption-threshold``
    under ``--enable-priority-scheduling``), a waiting request that finds no seat or
    blocks may preempt running requests whose priority is worse than its own by more
    than the threshold: the worst first, the latest of equals first.
    """

    def __init__(self, low_values_first: bool = True,
                 preemption_threshold: int | None = None) -> None:
        if preemption_threshold is not None and preemption_threshold < 0:
            raise ValueError(f"preemption_threshold: must be >= 0, got {preemption_threshold}")
        self.low_values_first = low_values_first
        self.preemption_threshold = preemption_threshold
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def _key(self, r: Request) -> tuple[int, float]:
        return (r.priority if self.low_values_first else -r.priority, r.arrival_time)

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

    def outranked(self, request: Request, running: list[Request]) -> list[Request]:
        if self.preemption_threshold is None:
            return []
        sign = 1 if self.low_values_first else -1
        out = []
        for r in sorted(running, key=self._key, reverse=True):
            if (r.priority - request.priority) * sign <= self.preemption_threshold:
                break  # the rest rank higher still
            out.append(r)
        return out


def has_progress(r: Request) -> bool:
    """Whether ``r`` holds or held progress: it was preempted (the scheduler freed its
    blocks and readded it), or arrives with tokens already computed or generated (a
    paused request keeping its KV, a continuation of tokens generated elsewhere)."""
    return r.num_preemptions > 0 or r.num_computed_tokens > 0 or r.num_output_tokens > 0


class ShortRequestFirstPolicy(SchedulingPolicy):
    """vLLM-Ascend's ShortRequestFirst waiting queue (``scheduler_config.
    short_request_first_config``): four lanes, served in this order, FCFS inside each:

        immediate  ``readd`` (preempted) and any request with progress (``has_progress``)
        aged-long  the long lane's head, once it has waited ``long_max_wait_ms`` and
                   short requests are waiting (0: never promoted by age)
        short      at most ``threshold`` prompt tokens
        long       the rest

    A long request's wait counts from when it joined the queue. ``pop`` removes what the
    last ``peek`` returned, even if the long head aged in between. The preempted request
    is FCFS's: the latest admitted.

    As vLLM-Ascend's queue does, it warns once when three long requests in a row were
    promoted by age ahead of waiting short ones (the threshold is probably too low), and
    logs its lane sizes and counters at most every 5 s, on queue events.
    """

    STATS_INTERVAL_S = 5.0
    AGED_STREAK_WARNING = 3

    def __init__(self, threshold: int = 256, long_max_wait_ms: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self.long_max_wait_ms = long_max_wait_ms
        self.clock = clock  # seconds, monotonic
        self.aged_promotions = 0  # long requests served ahead of waiting short ones
        self._immediate: deque[Request] = deque()
        self._short: deque[Request] = deque()
        self._long: deque[Request] = deque()
        self._joined: dict[Request, float] = {}  # long lane: when each request joined
        self._pinned: deque[Request] | None = None  # the lane ``peek`` answered from
        self._streak = 0  # consecutive aged long promotions
        self._warned = False
        self._stats_at = clock()
        self.prepends = {"immediate": 0, "short": 0, "long": 0}
        self.dispatches = {"immediate": 0, "short": 0, "long": 0}
        log.info("ShortRequestFirst waiting queue installed: threshold=%d, "
                 "long_max_wait_ms=%.3f", threshold, long_max_wait_ms)

    def _name(self, lane: deque[Request]) -> str:
        return ("immediate" if lane is self._immediate
                else "short" if lane is self._short else "long")

    def _log_stats(self) -> None:
        now = self.clock()
        if now - self._stats_at < self.STATS_INTERVAL_S:
            return
        self._stats_at = now
        log.info("ShortRequestFirst stats: threshold=%d long_max_wait_ms=%.3f sizes=("
                 "immediate=%d short=%d long=%d) prepends=%s dispatches=%s "
                 "aged_long_promotions=%d consecutive_aged_long_promotions=%d",
                 self.threshold, self.long_max_wait_ms, len(self._immediate),
                 len(self._short), len(self._long), self.prepends, self.dispatches,
                 self.aged_promotions, self._streak)

    def _lane_for(self, r: Request) -> deque[Request]:
        if has_progress(r):
            return self._immediate
        return self._short if r.num_prompt_tokens <= self.threshold else self._long

    def _aged(self, r: Request) -> bool:
        waited_ms = (self.clock() - self._joined[r]) * 1000.0
        return self.long_max_wait_ms > 0 and waited_ms >= self.long_max_wait_ms

    def _next_lane(self) -> deque[Request]:
        if self._immediate:
            return self._immediate
        if self._long and self._short and self._aged(self._long[0]):
            return self._long
        return self._short if self._short else self._long

    def add(self, request: Request) -> None:
        self._pinned = None
        lane = self._lane_for(request)
        lane.append(request)
        if lane is self._long:
            self._joined.setdefault(request, self.clock())
        self._log_stats()

    def readd(self, request: Request) -> None:
        self._pinned = None
        self._immediate.appendleft(request)
        self.prepends["immediate"] += 1
        self._log_stats()

    def peek(self) -> Request:
        self._pinned = self._next_lane()
        return self._pinned[0]

    def pop(self) -> Request:
        lane = self._pinned or self._next_lane()
        self._pinned = None
        request = lane.popleft()
        joined = self._joined.pop(request, None)
        self.dispatches[self._name(lane)] += 1
        if lane is self._short:
            self._streak = 0
        elif lane is self._long:
            aged = (self.long_max_wait_ms > 0 and joined is not None
                    and (self.clock() - joined) * 1000.0 >= self.long_max_wait_ms)
            if aged and self._short:
                self.aged_promotions += 1
                self._streak += 1
                if self._streak >= self.AGED_STREAK_WARNING and not self._warned:
                    self._warned = True
                    log.warning("ShortRequestFirst scheduling is repeatedly promoting long "
                                "requests ahead of waiting short requests and may degrade "
                                "toward long-request priority. Consider increasing the "
                                "short-request threshold or disabling this waiting-queue "
                                "policy.")
        if not self._short:  # no short request jumped: the streak is over
            self._streak = 0
        self._log_stats()
        return request

    def remove(self, request: Request) -> None:
        self._pinned = None
        for lane in (self._immediate, self._short, self._long):
            if request in lane:
                lane.remove(request)
                self._joined.pop(request, None)
                if not self._short:
                    self._streak = 0
                self._log_stats()
                return
        raise ValueError(f"request {request.request_id} is not waiting")

    def __len__(self) -> int:
        return len(self._immediate) + len(self._short) + len(self._long)

    def __iter__(self) -> Iterator[Request]:
        """Lane by lane (immediate, short, long), without the aged-long promotion."""
        return itertools.chain(self._immediate, self._short, self._long)

    def victim(self, running: list[Request]) -> Request:
        return running[-1]


class _Reordered(FCFSPolicy):
    """A queue in arrival order that the scheduler has ordered again before each
    step's admission (``reorder``, given how many prompt tokens of a request the prefix
    cache holds); a preempted request goes first until then."""

    def reorder(self, cached_tokens: Callable[[Request], int]) -> None:
        """Sort the queue in place (stable: arrival order breaks ties)."""


class LongestPrefixMatchPolicy(_Reordered):
    """SGLang's lpm (``schedule_policy.py``): the request with the most prompt tokens in
    the prefix cache first. One whose cached prefix is short (<= ``check`` tokens) but
    that shares at least ``shared`` tokens with a request ahead of it waits behind the
    rest this step (its prefix is computed by that one, then a hit: SGLang's in-batch
    prefix caching). Past ``max_sorted`` waiting requests it is fcfs, as SGLang's."""

    def __init__(self, block_size: int = 16, check: int = 32, shared: int = 32,
                 max_sorted: int = 128):
        super().__init__()
        self.block_size = block_size
        self.check, self.shared, self.max_sorted = check, shared, max_sorted

    def reorder(self, cached_tokens: Callable[[Request], int]) -> None:
        if len(self._queue) > self.max_sorted:
            return
        cached = {id(r): cached_tokens(r) for r in self._queue}
        seen: set[bytes] = set()
        later: set[int] = set()
        for r in self._queue:
            if cached[id(r)] > self.check:
                continue
            shared = 0  # (the block hashes: cached_tokens computed them)
            for h in r.block_hashes:
                if h not in seen:
                    break
                shared += self.block_size
            if shared >= self.shared:
                later.add(id(r))
            else:
                seen.update(r.block_hashes)
        self._queue = deque(sorted(self._queue, key=lambda r: (
            id(r) in later, -cached[id(r)])))


class LongestOutputFirstPolicy(_Reordered):
    """SGLang's lof: the largest max_tokens first."""

    def reorder(self, cached_tokens: Callable[[Request], int]) -> None:
        self._queue = deque(sorted(self._queue,
                                   key=lambda r: -(r.sampling_params.max_tokens or 0)))


class RandomPolicy(_Reordered):
    """SGLang's random: the queue shuffled before each admission (seeded)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def reorder(self, cached_tokens: Callable[[Request], int]) -> None:
        order = list(self._queue)
        self._rng.shuffle(order)
        self._queue = deque(order)


POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy,
            "short_request_first": ShortRequestFirstPolicy,
            "lpm": LongestPrefixMatchPolicy, "lof": LongestOutputFirstPolicy,
            "random": RandomPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    """The policy ``name`` with its default knobs."""
    if name not in POLICIES:
        raise ValueError(f"scheduling_policy: must be one of {', '.join(POLICIES)}, got {name!r}")
    return POLICIES[name]()


def policy_from_config(config: EngineConfig) -> SchedulingPolicy:
    """The policy ``config.scheduling_policy`` with the config's knobs."""
    if config.scheduling_policy == "priority":
        return PriorityPolicy(low_values_first=config.priority_low_values_first,
                              preemption_threshold=config.priority_preemption_threshold)
    if config.scheduling_policy == "short_request_first":
        return ShortRequestFirstPolicy(config.short_request_threshold,
                                       config.short_request_long_max_wait_ms)
    if config.scheduling_policy == "lpm":
        return LongestPrefixMatchPolicy(config.block_size)
    if config.scheduling_policy == "random":
        return RandomPolicy(config.seed)
    return make_policy(config.scheduling_policy)
