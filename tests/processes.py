"""Process checks for tests that stop services and look for what is left."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(logs: Path, port: int) -> subprocess.Popen:
    """A redis of the test's own on 127.0.0.1:``port``, empty, ready on return."""
    log = logs / f"redis-{time.monotonic_ns()}.log"
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port),
                             "--save", "", "--appendonly", "no", "--dir", str(logs)],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    deadline = time.monotonic() + 10
    while b"Ready to accept connections" not in log.read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return proc
