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


class Service:
    """A `pdmesh <command>` child that prints "<role> ready: {json}" once serving."""

    def __init__(self, role: str, args: list[str], log_dir: Path, timeout_s: float = 120.0,
                 env: dict[str, str] | None = None, wait: bool = True,
                 echo: str | None = None):
        """``wait`` False: return at once, ``wait_ready`` later (ranks that must all be
        running before any is ready). ``echo``: also print the child's lines, prefixed."""
        self.role = role
        self.echo = echo
        self.log_path = log_dir / f"{role}-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdmesh", *args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, **(env or {})}, preexec_fn=die_with_parent)
        self.info: dict[str, Any] = {}
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if wait:
            self.wait_ready(timeout_s)

    def join_output(self, timeout_s: float = 1.0) -> None:
        """Until the child's output is all in the log (after it exited)."""
        self._reader.join(timeout_s)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        if not self._ready.wait(timeout_s) or not self.info:
            self.stop()
            raise RuntimeError(f"{self.role} did not become ready; log: {self.log_path}\n"
                               + self.log_path.read_text()[-3000:])

    def _read(self) -> None:
        prefix = f"{self.role} ready: "
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:  # type: ignore[union-attr]
                log.write(line)
                log.flush()
                if self.echo is not None:
                    sys.stdout.write(self.echo + line)
                    sys.stdout.flush()
                if line.startswith(prefix) and not self.info:
                    self.info = json.loads(line[len(prefix):])
                    self._ready.set()
        self._ready.set()

    @property
    def address(self) -> str:
        return self.info["grpc"]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
