"""A prefill engine and a decode engine of one box taking turns on its cores (`pdmesh up`).

On one box the PD mesh's engines share the cores (``shared.cli.up.engine_threads``). A
decode engine with a few requests steps back to back, a few milliseconds a step, and
keeps a core busy for a handful of tokens, while the prefill engine beside it computes
prompts that every waiting client needs before its first token. So, while any prefill
engine of the box has prompt tokens left to compute, a decode engine can wait ``yield_factor``
times the length of its last step before the next one, and no longer than its TPOT budget
(``--decode-tpot-slo-ms``) minus the step: its requests' TPOT grows for as long as
prefill has work (a mixed instance's decode rows wait for the prefill chunks in its steps
the same way), and the prefill engine gets the cores. The wait ends as soon as prefill
has nothing left, or a message reaches the decode engine.

Off unless asked for: ``PDMESH_DECODE_YIELD=F`` (F > 0) in `pdmesh up`'s environment.
Then the prefill engine's threads also spin briefly before they sleep (``engine_threads``)
and, backed up (``below``), it steps on one thread (``prefill_threads``). It trades ITL
for TTFT: measured on 2 cores with long prompts at a steady rate (docs/benchmarks.md,
issue 40, session 26), F=10 brought the PD mesh's TTFT p50 down 10-24% (to 0.96-1.22x
the mixed instance's), its ITL p99 up 10-70%, throughput with the box full within noise.

The engines meet in a small file (``pdmesh up`` names it in ``PDMESH_SHARED_CORES``, in
/dev/shm where there is one): a prefill engine writes its prompt tokens left and when, in
a slot of its own, before each step (the step is the work to yield to: a prompt computed
in one step would otherwise never show) and after it; a decode engine reads every slot
after each step, and while it waits. A slot not written for ``STALE_S`` (its engine
stopped or hung) counts as idle.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Mapping

PATH_ENV = "PDMESH_SHARED_CORES"
YIELD_ENV = "PDMESH_DECODE_YIELD"
# prefill backed up this far (prompt tokens left, all its engines): decode steps on (the
# gateway offloads prompts to it then); `pdmesh up` gives its --prefill-offload-threshold
BELOW_ENV = "PDMESH_DECODE_YIELD_BELOW"
SLOTS = 64  # prefill engines of one box (slot = pid % SLOTS)
STALE_S = 5.0  # (longer than any one prefill step: it writes between steps)
_SLOT = struct.Struct("<qd")  # prompt tokens left, time.monotonic() of the write


def create(path: str) -> None:
    """The file, every slot idle."""
    with open(path, "wb") as f:
        f.write(bytes(_SLOT.size * SLOTS))


def requested_yield(environ: Mapping[str, str]) -> float:
    """The factor ``PDMESH_DECODE_YIELD`` asks for (0: not asked for)."""
    raw = environ.get(YIELD_ENV, "")
    try:
        factor = float(raw or 0)
    except ValueError:
        raise ValueError(f"{YIELD_ENV}: expected a number, got {raw!r}") from None
    if not factor >= 0:
        raise ValueError(f"{YIELD_ENV}: must be >= 0, got {raw!r}")
    return factor


class SharedCores:
    def __init__(self, path: str, yield_factor: float = 2.0, below: int = 0):
        """``below``: yield only while the prefill engines have fewer prompt tokens left
        than this (0: whatever they have)."""
        if yield_factor < 0:
            raise ValueError(f"{YIELD_ENV}: must be >= 0, got {yield_factor}")
        self.yield_factor = yield_factor
        self.below = below
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _SLOT.size * SLOTS)
        self._at = (os.getpid() % SLOTS) * _SLOT.size

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SharedCores | None:
        """The box's file when ``pdmesh up`` named one (decode yields asked for); None
        otherwise."""
        env = os.environ if environ is None else environ
        path, factor = env.get(PATH_ENV), requested_yield(env)
        raw = env.get(BELOW_ENV, "") or "0"
        if not raw.isdigit():
            raise ValueError(f"{BELOW_ENV}: expected a number of tokens, got {raw!r}")
        return cls(path, factor, int(raw)) if path and factor else None

    def publish(self, prompt_tokens_left: int) -> None:
        """A prefill engine's work left (before and after each of its steps)."""
        _SLOT.pack_into(self._map, self._at, prompt_tokens_left, time.monotonic())

    def prefill_left(self) -> int:
        """The prompt tokens the box's prefill engines have left (slots written lately)."""
        now = time.monotonic()
        total = 0
        for at in range(0, _SLOT.size * SLOTS, _SLOT.size):
            left, when = _SLOT.unpack_from(self._map, at)
            if left > 0 and now - when < STALE_S:
                total += left
        return total

    def prefill_busy(self) -> bool:
        """Some prefill engine of the box has prompt tokens left (written lately)."""
        return self.prefill_left() > 0

    def pause_after(self, step_s: float, budget_ms: float = 0.0) -> float:
        """Seconds a decode engine may wait after a step that took ``step_s``: while the
        prefill engines have work, and (``below``) are not backed up; ``budget_ms`` (the
        decode engine's TPOT budget, 0: none) caps the step and the wait together."""
        if not self.yield_factor:
            return 0.0
        left = self.prefill_left()
        if not left or self.backed_up(left):
            return 0.0
        pause = self.yield_factor * step_s
        if budget_ms:
            pause = min(pause, budget_ms / 1e3 - step_s)
        return max(0.0, pause)

    def backed_up(self, prefill_left: int) -> bool:
        """The box's prefill engines have so much left (``below``) that decode steps on
        beside them instead of yielding."""
        return bool(self.below) and prefill_left >= self.below

    def prefill_threads(self, prefill_left: int, full: int) -> int:
        """The torch threads a prefill engine steps with: all of its ``full`` while the
        decode engines yield to it, one while backed up and decode steps on beside it
        (its threads would wait for, or spin on, decode's core)."""
        return 1 if self.backed_up(prefill_left) else full

    def close(self) -> None:
        self._map.close()
