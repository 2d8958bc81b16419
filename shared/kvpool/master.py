"""Runs the real ``mooncake_master`` (with its built-in HTTP metadata server) as a child
process and restarts it whenever it dies.

    MasterSupervisor.start() -> mooncake_master -rpc_port=P -enable_http_metadata_server=true
                                  -http_metadata_server_port=H -metrics_port=M
    watch thread: child exited? -> log, count, start it again (same ports)

Eviction: the master evicts objects once its memory passes the high watermark, but
never one whose lease is live, and every read takes a lease (Mooncake's default: 10 s).
A decode instance reads each prompt's blocks moments after prefill wrote them, so with
the default lease a burst of prompts pins everything it touched and new puts fail until
the leases run out. A lease only has to cover one transfer, so pdmesh asks for a short
one (``EvictionPolicy.lease_ttl_ms``) and the pool keeps accepting puts, dropping its
oldest blocks, as a cache should.
"""

from __future__ import annotations

import logging
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from pdmesh.shared.infra.launcher import die_with_parent
from pdmesh.shared.infra.net import free_port, listening_ports

log = logging.getLogger(__name__)


def find_master_binary() -> str:
    """``mooncake_master`` from the mooncake wheel: beside this Python, else on PATH."""
    beside = Path(sys.executable).with_name("mooncake_master")
    if beside.is_file():
        return str(beside)
    found = shutil.which("mooncake_master")
    if found is None:
        raise FileNotFoundError("kvstore: mooncake_master not found (pip install "
                                "mooncake-transfer-engine-non-cuda; Debian needs libibverbs1)")
    return found


@dataclass(frozen=True)
class EvictionPolicy:
    lease_ttl_ms: int = 1000  # how long a read pins an object against eviction
    high_watermark_ratio: float = 0.9  # memory use that starts an eviction
    eviction_ratio: float = 0.05  # share of objects one eviction frees

    def __post_init__(self) -> None:
        if self.lease_ttl_ms < 1:
            raise ValueError(f"--kv-lease-ttl-ms: must be at least 1 (got {self.lease_ttl_ms})")
        if not 0.0 < self.high_watermark_ratio <= 1.0:
            raise ValueError("--eviction-high-watermark-ratio: must be in (0, 1] "
                             f"(got {self.high_watermark_ratio})")
        if not 0.0 < self.eviction_ratio <= 1.0:
            raise ValueError(f"--eviction-ratio: must be in (0, 1] (got {self.eviction_ratio})")

    def flags(self) -> list[str]:
        return [f"-default_kv_lease_ttl={self.lease_ttl_ms}",
                f"-eviction_high_watermark_ratio={self.high_watermark_ratio}",
                f"-eviction_ratio={self.eviction_ratio}"]


_STARTS = 3  # tries of a master on ports chosen at start


class MasterExited(RuntimeError):
    """The master process ended before it was ready (a port taken, a bad flag)."""


@dataclass(frozen=True)
class MasterPorts:
    host: str  # where the master binds
    rpc: int  # 0: chosen free at start (as metadata and metrics)
    metadata: int
    metrics: int
    advertise: str = ""  # where clients reach it (default: host)

    @property
    def chooses(self) -> bool:
        return 0 in (self.rpc, self.metadata, self.metrics)

    def chosen(self) -> MasterPorts:
        """These ports with each 0 replaced by one free on ``host`` now."""
        return replace(self, rpc=self.rpc or free_port(self.host),
                       metadata=self.metadata or free_port(self.host),
                       metrics=self.metrics or free_port(self.host))

    @property
    def reach(self) -> str:
        if self.advertise:
            return self.advertise
        return "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host

    @property
    def master_address(self) -> str:
        return f"{self.reach}:{self.rpc}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.reach}:{self.metadata}/metadata"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.reach}:{self.metrics}/metrics"


class MasterSupervisor:
    def __init__(self, ports: MasterPorts, log_path: str | None = None,
                 restart_delay_s: float = 0.5, eviction: EvictionPolicy | None = None):
        self._wanted = ports
        self.ports = ports  # with every port known from start() on
        self.eviction = eviction or EvictionPolicy()
        self.restarts = 0
        self._binary = find_master_binary()
        self._log_path = log_path
        self._delay = restart_delay_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _spawn(self) -> None:
        p = self.ports
        cmd = [self._binary, f"-rpc_address={p.host}", f"-rpc_port={p.rpc}",
               "-enable_http_metadata_server=true", f"-http_metadata_server_host={p.host}",
               f"-http_metadata_server_port={p.metadata}", f"-metrics_host={p.host}",
               f"-metrics_port={p.metrics}",
               *self.eviction.flags()]
        out = open(self._log_path, "ab") if self._log_path else subprocess.DEVNULL  # noqa: SIM115
        self._proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        log.info("mooncake_master pid %d on %s (metadata %s)", self._proc.pid,
                 p.master_address, p.metadata_url)

    def start(self, ready_timeout_s: float = 15.0) -> None:
        """The master, ready. A port chosen free can be handed to another process (an
        outgoing connection's source port) before the master binds it, and the master
        then exits at start: on ports it chose, it is started again on fresh ones."""
        for attempt in range(1, _STARTS + 1):
            self.ports = self._wanted.chosen()
            with self._lock:
                self._spawn()
            try:
                self.wait_ready(ready_timeout_s)
                break
            except MasterExited:
                if not self._wanted.chooses or attempt == _STARTS:
                    raise
                log.warning("mooncake_master exited at start on %s (try %d of %d); "
                            "fresh ports", self.ports.master_address, attempt, _STARTS)
        self._watcher = threading.Thread(target=self._watch, name="master-watch", daemon=True)
        self._watcher.start()

    def wait_ready(self, timeout_s: float) -> None:
        """Until the master itself listens on its three ports (another process's listener
        on one of them accepts connections too, and the master then exits) and its
        metrics answer."""
        p = self.ports
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise MasterExited(f"kvstore: mooncake_master exited with {self._proc.returncode}")
            own = listening_ports(self._proc.pid) if self._proc is not None else None
            if own is not None and not {p.rpc, p.metadata, p.metrics} <= own:
                time.sleep(0.05)
                continue
            try:
                with socket.create_connection((self.ports.reach, self.ports.rpc), timeout=0.5):
                    pass
                urllib.request.urlopen(self.ports.metrics_url, timeout=0.5).read()
                return
            except (OSError, urllib.error.URLError):
                time.sleep(0.05)
        raise TimeoutError(f"kvstore: mooncake_master not ready on {self.ports.master_address} "
                           f"after {timeout_s}s")

    def _watch(self) -> None:
        while not self._stopping.is_set():
            proc = self._proc
            if proc is not None and proc.poll() is not None and not self._stopping.is_set():
                log.warning("mooncake_master exited with %s; restarting", proc.returncode)
                time.sleep(self._delay)
                with self._lock:
                    if self._stopping.is_set():
                        return
                    self._spawn()
                    self.restarts += 1
                try:
                    self.wait_ready(15.0)
                except (RuntimeError, TimeoutError) as e:
                    log.error("%s", e)
            self._stopping.wait(0.2)

    def metrics(self) -> dict[str, float]:
        """The master's own gauges (key count, allocated bytes, ...), unlabelled ones."""
        text = urllib.request.urlopen(self.ports.metrics_url, timeout=2).read().decode()
        out = {}
        for m in re.finditer(r"^([a-zA-Z_:][\w:]*) ([-+\d.eE]+)$", text, re.MULTILINE):
            out[m.group(1)] = float(m.group(2))
        return out

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        with self._lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._watcher is not None:
            self._watcher.join(timeout_s)
