"""``--data-parallel-size N`` without a rank: start the N rank processes of one instance.

Each rank is a full engine service (its own gRPC port and registry entry), all joined
by one process group whose store rank 0 serves at ``--data-parallel-address:
--data-parallel-rpc-port``. The launcher prints one ready line for them all, and stops
them all on SIGTERM / SIGINT or as soon as one dies.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdmesh.shared.infra.launcher import Service, ready_timeout_s
from pdmesh.shared.infra.net import free_port, reachable_host
from pdmesh.shared.runtime.host import HostSettings, ServiceHost

log = logging.getLogger(__name__)


def launch_ranks(a: Any, role: str) -> int:
    """``a``: the instance's ServeConfig (its flags read as attributes)."""
    host = a.data_parallel_address or reachable_host(a.host)
    rpc_port = a.data_parallel_rpc_port or free_port(host)
    logs = Path(tempfile.mkdtemp(prefix=f"pdmesh-{role}-dp-"))
    ranks: list[Service] = []
    with ServiceHost(HostSettings(role, a.host)) as launcher:
        try:
            for r in range(a.data_parallel_size):
                ranks.append(Service(role, _rank_args(a, r, host, rpc_port), logs,
                                     wait=False, echo=f"[dp{r}] "))
            _wait_for_ranks(ranks, timeout_s=ready_timeout_s())
            launcher.ready(grpc=ranks[0].address, ranks=[s.address for s in ranks],
                           dp_size=a.data_parallel_size, pids=[s.proc.pid for s in ranks],
                           eplb_group=f"{role}@{host}:{rpc_port}",
                           metrics=[s.info.get("metrics") for s in ranks], logs=str(logs),
                           model=ranks[0].info.get("model"))
            while not launcher.signals.wait(0.5):
                dead = [i for i, s in enumerate(ranks) if s.proc.poll() is not None]
                if dead:
                    log.error("%s: rank(s) %s exited; stopping the instance", role, dead)
                    return 1
            return 0
        finally:
            _stop_ranks(ranks, a.shutdown_timeout)


def _rank_args(a: Any, rank: int, host: str, rpc_port: int) -> list[str]:
    args = [*sys.argv[1:], "--data-parallel-rank", str(rank), "--data-parallel-address",
            host, "--data-parallel-rpc-port", str(rpc_port)]
    if a.port:
        args += ["--port", str(a.port + rank)]
    if a.metrics_port > 0:
        args += ["--metrics-port", str(a.metrics_port + rank)]
    return args


def _stop_ranks(ranks: list[Service], shutdown_timeout_s: float) -> None:
    for svc in ranks:  # SIGTERM to all at once: they agree to stop at the next step
        if svc.proc.poll() is None:
            os.killpg(svc.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + shutdown_timeout_s + 10  # the ranks drain first
    for svc in ranks:
        svc.stop(timeout_s=max(0.1, deadline - time.monotonic()))


def _wait_for_ranks(ranks: list[Service], timeout_s: float) -> None:
    """Until every rank is ready; the first rank to exit before that ends the wait with
    its own error (the others would wait for it in the process group until timeout)."""
    deadline = time.monotonic() + timeout_s
    while not all(s.info for s in ranks):
        for r, s in enumerate(ranks):
            if not s.info and s.proc.poll() is not None:
                raise ValueError(f"data parallel rank {r} failed to start: {_why(s)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"data parallel ranks not ready after {timeout_s:.0f} s "
                               "(PDMESH_READY_TIMEOUT_S / VLLM_ENGINE_READY_TIMEOUT_S)")
        time.sleep(0.05)


def _why(s: Service) -> str:
    s.join_output()
    lines = [ln for ln in s.log_path.read_text().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("pdmesh: error: ")]
    if errors:
        return errors[-1].removeprefix("pdmesh: error: ")
    return lines[-1] if lines else f"exit status {s.proc.returncode}"

