"""Starting pdmesh services as child processes: each in its own process group, ready
when it prints "<role> ready: {json}", stopped by process id (group) whatever happens.
Used by `pdmesh up` and by the end-to-end tests."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# Looked up here, not in the child: between fork and exec the child may only call what is
# already resolved (another thread could have held the import lock at fork time).
_prctl = ctypes.CDLL(None, use_errno=True).prctl
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """A ``preexec_fn``: the kernel kills the child when the process that started it
    dies (killed, crashed), so no helper process outlives its owner."""
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


READY_TIMEOUT_ENV = ("PDMESH_READY_TIMEOUT_S", "VLLM_ENGINE_READY_TIMEOUT_S")
READY_TIMEOUT_S = 600.0  # vLLM's default: a large checkpoint loads for minutes


def ready_timeout_s() -> float:
    """How long a started service or rank gets to say it is ready: PDMESH_READY_TIMEOUT_S,
    else vLLM's VLLM_ENGINE_READY_TIMEOUT_S, else 600 s. A child that exits before is
    reported at once, whatever the timeout. ValueError naming the variable for a value
    that is not a positive number of seconds."""
    for name in READY_TIMEOUT_ENV:
        raw = os.environ.get(name, "").strip()
        if not raw:
            continue
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 0 < value < float("inf"):
            raise ValueError(f"{name}={raw!r}: expected a positive number of seconds")
        return value
    return READY_TIMEOUT_S


class Service:
    """A `pdmesh <command>` child that prints "<role> ready: {json}" once serving."""

    def __init__(self, role: str, args: list[str], log_dir: Path,
                 timeout_s: float | None = None,
                 env: dict[str, str] | None = None, wait: bool = True,
                 echo: str | None = None):
        """``wait`` False: return at once, ``wait_ready`` later (ranks that must all be
        running before any is ready). ``echo``: also print the child's lines, prefixed."""
        self.role = role
        self.echo = echo
        self.args = list(args)
        self.env = dict(env or {})
        self.log_dir = log_dir
        self.starts = 0
        self._spawn()
        if wait:
            self.wait_ready(timeout_s)

    def _spawn(self) -> None:
        self.starts += 1
        self.log_path = self.log_dir / f"{self.role}-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdmesh", *self.args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, **self.env}, preexec_fn=die_with_parent)
        self.started_at = time.monotonic()
        self.info: dict[str, Any] = {}
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        args=(self.proc, self.log_path, self._ready))
        self._reader.start()

    def respawn(self, flags: dict[str, str] | None = None,
                timeout_s: float | None = None) -> None:
        """Start the (exited) command again, ``flags`` replacing or adding values (its
        old ports, so that whoever knew its address finds it again); ready on return."""
        self.stop()
        args = list(self.args)
        for flag, value in (flags or {}).items():
            if flag in args:
                args[args.index(flag) + 1] = value
            else:
                args += [flag, value]
        self.args = args
        self._spawn()
        self.wait_ready(timeout_s)

    def join_output(self, timeout_s: float = 1.0) -> None:
        """Until the child's output is all in the log (after it exited)."""
        self._reader.join(timeout_s)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        if timeout_s is None:
            timeout_s = ready_timeout_s()
        if not self._ready.wait(timeout_s) or not self.info:
            why = ("exited" if self.proc.poll() is not None else
                   f"not within {timeout_s:.0f} s (PDMESH_READY_TIMEOUT_S)")
            self.stop()
            raise RuntimeError(f"{self.role} did not become ready ({why}); log: "
                               f"{self.log_path}\n"
                               + self.log_path.read_text()[-3000:])

    def _read(self, proc: subprocess.Popen, log_path: Path, ready: threading.Event) -> None:
        """One run's output into its log (a respawn's reader is another one)."""
        prefix = f"{self.role} ready: "
        with open(log_path, "w") as log:
            for line in proc.stdout:  # type: ignore[union-attr]
                log.write(line)
                log.flush()
                if self.echo is not None:
                    sys.stdout.write(self.echo + line)
                    sys.stdout.flush()
                if line.startswith(prefix) and not ready.is_set():
                    self.info = json.loads(line[len(prefix):])
                    ready.set()
        ready.set()

    @property
    def address(self) -> str:
        return self.info["grpc"]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.signal(sig)
            self.wait_stopped(timeout_s)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait_stopped(self, timeout_s: float) -> None:
        """Until it exits; killed (its process group) past ``timeout_s``."""
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait()


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM,
               timeout_s: float = 60.0) -> None:
    """A process started in its own session, and all it started: ``sig`` to its group,
    then SIGKILL past ``timeout_s``; returns once it has exited."""
    for each, wait in ((sig, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, each)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def stop_together(services: list[Service], timeout_s: float = 15.0) -> None:
    """SIGTERM to every one still running at once (their drains overlap instead of
    adding up), then each waited for until ``timeout_s`` from now and killed past it."""
    live = [s for s in services if s.proc.poll() is None]
    for s in live:
        s.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for s in live:
        s.wait_stopped(max(0.1, deadline - time.monotonic()))
