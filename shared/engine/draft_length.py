"""How many drafts per request a step verifies: as many as pay for themselves.

A draft costs its row in the verifying forward (and the proposer's work); it earns a
token only when accepted. At low load a step costs about the same whatever its rows
(launches, weights read once), so every draft earns; at high load on a compute-bound
device a step costs in proportion to its rows, and drafts that are mostly rejected
cost throughput. ``DraftLength`` measures both sides as the engine runs and picks, for
the next step, the number of drafts k (0 .. the configured count) that gives the most
tokens per second:

    tokens(k)   = m + n * (1 + A_k)        A_k = sum over j < k of accepted_j / asked_j
    rows(k)     = m + n * (1 + D_k)        D_k = sum over j < k of verified_j / asked_j
    seconds(k)  = T(rows(k)) + P_k(n)

n the requests about to decode that may be drafted for, m the other decoding rows;
``asked_j`` counts requests whose proposer was asked for a (j+1)-th draft,
``verified_j`` those that verified one, ``accepted_j`` those that kept it (both after
any verify budget). T: the measured time of pure-decode steps (the proposer's work
left out) by rows, kept in half-octave buckets (moving means) and read between them
by linear interpolation. P_k(n): the proposer's measured time to draft k tokens for n
requests (an MTP layer's forwards: much of it the same for one request as for many),
kept the same way by n; measured at one n only, it is taken as that for fewer requests
and in proportion for more; for a k not measured, the longest measured in proportion to
k; P_0 = 0 (a step drafting nothing skips the proposer).

Lengths within ``TIE`` of the best rate count as tied, and the longest of them is taken.
Until some verifications are measured it gives the configured count; then, if no step
as small as one without drafts was ever measured, it chooses none once, to measure
it (with MTP the requests decoding then are drafted for no more).

Counts decay (each observation weighs ``1 - DECAY`` of the history), so the choice
follows the traffic and the model's acceptance as they change."""

from __future__ import annotations

import math

DECAY = 0.02  # the weight of a new observation in the moving means and counts
MIN_ASKED = 4.0  # a position's rates count once this many requests were asked for it
# lengths whose rate is within this fraction of the best count as tied (the step times
# are moving means on a shared machine); of tied lengths the longest is taken, as more
# drafts make the running requests' tokens come sooner
TIE = 0.03


class DraftLength:
    def __init__(self, k: int):
        self.k = k
        self.asked = [0.0] * k
        self.verified = [0.0] * k
        self.accepted = [0.0] * k
        # bucket -> [observations, mean rows, mean seconds]
        self._steps: dict[int, list[float]] = {}
        # k -> (bucket of requests asked -> [observations, mean requests, mean seconds])
        self._proposer: dict[int, dict[int, list[float]]] = {}

    # -- what the engine tells it -----------------------------------------------------
    def record_asked(self, requests: int, k: int) -> None:
        """A decision: the proposer asked for ``k`` drafts (0: none) for each of
        ``requests`` requests. Every decision ages the counts, so a length not chosen
        for a while falls below MIN_ASKED and is asked for again."""
        if not requests:
            return
        for j in range(self.k):
            self.asked[j] *= 1 - DECAY
            self.verified[j] *= 1 - DECAY
            self.accepted[j] *= 1 - DECAY
            if j < k:
                self.asked[j] += requests

    def record_verified(self, drafted: int, accepted: int) -> None:
        """A request verified ``drafted`` drafts and kept ``accepted`` of them."""
        for j in range(min(drafted, self.k)):
            self.verified[j] += 1
            if j < accepted:
                self.accepted[j] += 1

    def record_step(self, rows: int, seconds: float) -> None:
        """A step that decoded ``rows`` rows (drafts included) and computed no prompt
        tokens took ``seconds`` (its proposer's work not counted)."""
        if rows > 0 and seconds > 0:
            _observe(self._steps, rows, seconds)

    def record_proposer(self, requests: int, k: int, seconds: float) -> None:
        """The proposer took ``seconds`` to propose ``k`` drafts for each of
        ``requests`` requests (and, MTP, to absorb the step before)."""
        if requests > 0 and k > 0 and seconds > 0:
            _observe(self._proposer.setdefault(k, {}), requests, seconds)

    # -- the choice -------------------------------------------------------------------
    def choose(self, drafted: int, others: int) -> int:
        """The drafts per request for a step that decodes ``drafted`` requests that may
        be drafted for and ``others`` that may not."""
        if not drafted or self.k == 0 or self.asked[0] < MIN_ASKED or not self._steps:
            return self.k
        points = sorted((b[1], b[2]) for b in self._steps.values())
        if points[0][0] > 1.5 * (others + drafted):
            return 0  # what a step without drafts costs was never measured: measure it
        if len(points) < 2:
            return self.k
        rates: list[float] = []
        rows = tokens = 0.0
        for k in range(self.k + 1):
            if k:
                j = k - 1
                if self.asked[j] < MIN_ASKED:
                    # not asked this far lately: when the longest length measured is
                    # the best so far, the longer ones may pay too - ask for them
                    best = _best(rates)
                    return self.k if best == j else best
                rows += self.verified[j] / self.asked[j]
                tokens += self.accepted[j] / self.asked[j]
            seconds = _interpolate(points, others + drafted * (1 + rows)) \
                + self._proposer_seconds(k, drafted)
            rates.append((others + drafted * (1 + tokens)) / seconds)
        return _best(rates)

    def _proposer_seconds(self, k: int, requests: int) -> float:
        """P_k(requests)."""
        if k == 0 or not self._proposer:
            return 0.0
        if k in self._proposer:
            return _cost(self._proposer[k], requests)
        most = max(self._proposer)
        return _cost(self._proposer[most], requests) * k / most

    def seconds_at(self, rows: float) -> float | None:
        """The step time the measurements give for ``rows`` rows (None: too few)."""
        points = sorted((b[1], b[2]) for b in self._steps.values())
        return _interpolate(points, rows) if len(points) >= 2 else None


def _best(rates: list[float]) -> int:
    """The longest length whose rate is within ``TIE`` of the best."""
    top = max(rates)
    return max(k for k, r in enumerate(rates) if r >= (1 - TIE) * top)


def _bucket(rows: int) -> int:
    return int(2 * math.log2(rows))


def _observe(buckets: dict[int, list[float]], x: int, seconds: float) -> None:
    """One measurement into its half-octave bucket's moving means."""
    b = buckets.setdefault(_bucket(x), [0.0, 0.0, 0.0])
    b[0] += 1
    w = max(1.0 / b[0], DECAY)
    b[1] += (x - b[1]) * w
    b[2] += (seconds - b[2]) * w


def _cost(buckets: dict[int, list[float]], x: float) -> float:
    """The buckets' time at ``x``: interpolated; from one bucket alone, its time for
    less and its time in proportion for more."""
    points = sorted((b[1], b[2]) for b in buckets.values())
    if len(points) == 1:
        x0, y0 = points[0]
        return y0 * max(1.0, x / x0)
    return _interpolate(points, x)


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """The piecewise-linear function through ``points`` (sorted by x, at least two) at
    ``x``, extended past the ends by the end segments' slopes (never falling: a step
    with more rows is not cheaper), and never below a tenth of the cheapest point."""
    floor = 0.1 * min(y for _, y in points)
    i = 1
    while i < len(points) - 1 and points[i][0] < x:
        i += 1
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    slope = max(0.0, (y1 - y0) / (x1 - x0)) if x1 > x0 else 0.0
    return max(floor, y0 + slope * (x - x0))
