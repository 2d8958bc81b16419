"""``--data-parallel-size N`` without a rank: start the N rank processes of one instance.

Each rank is a full engine service (its own gRPC port and registry entry), all joined
by one process group whose store rank 0 serves at ``--data-parallel-address:
--data-parallel-rpc-port``. The launcher prints one ready line for them all, and stops
them all on SIGTERM / SIGINT or as soon as one dies.

Across nodes, as vLLM's multi-node DP: each node's launcher starts only its own ranks,
``--data-parallel-start-rank S`` to ``S + --data-parallel-size-local L - 1``, all dialling
the same ``--data-parallel-address:--data-parallel-rpc-port`` (rank 0's node). The ranks
of a node take its devices in order: local rank i gets the i-th device of the node (its
``ASCEND_RT_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES`` when set), as the only device
its process sees.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdmesh.shared.infra.launcher import Service, ready_timeout_s, stop_together
from pdmesh.shared.infra.net import free_port, reachable_host
from pdmesh.shared.runtime.host import HostSettings, ServiceHost

log = logging.getLogger(__name__)


VISIBLE_DEVICES = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}


def local_ranks(a: Any) -> range:
    """The ranks this node runs. ValueError naming the flag for a split that cannot
    work: ranks past the instance's size, or a multi-node instance whose nodes could not
    find rank 0 (no fixed address and port)."""
    size = a.data_parallel_size
    local = size if a.data_parallel_size_local is None else a.data_parallel_size_local
    start = a.data_parallel_start_rank or 0
    if not 0 <= start < size:
        raise ValueError(f"--data-parallel-start-rank: must be in [0, {size}), got {start}")
    if not 1 <= local <= size - start:
        raise ValueError(f"--data-parallel-size-local: ranks {start}..{start + local - 1} "
                         f"do not fit in --data-parallel-size {size}")
    if local < size:  # other nodes run the rest: they all dial rank 0's node
        if a.data_parallel_rpc_port is None:
            raise ValueError("--data-parallel-rpc-port: a multi-node instance (--data-"
                             "parallel-size-local < --data-parallel-size) needs the port "
                             "every node dials, given the same on each")
        if start > 0 and not a.data_parallel_address:
            raise ValueError("--data-parallel-address: a node without rank 0 (--data-"
                             "parallel-start-rank > 0) needs the address of rank 0's node")
    return range(start, start + local)


def device_env(device: str, local_index: int, per_rank: int = 1,
               environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that gives local rank ``local_index`` its own ``per_rank`` devices
    of this node: the matching entries of the node's visible-devices variable, or device
    numbers when it is unset. Nothing for cpu. ValueError when the node has too few."""
    var = VISIBLE_DEVICES.get(device)
    if var is None:
        return {}
    environ = os.environ if environ is None else environ
    wanted = range(local_index * per_rank, (local_index + 1) * per_rank)
    raw = environ.get(var, "").strip()
    if not raw:
        return {var: ",".join(str(i) for i in wanted)}
    visible = [d.strip() for d in raw.split(",") if d.strip()]
    if wanted.stop > len(visible):
        raise ValueError(f"{var}={raw}: {len(visible)} device(s) visible, but local DP rank "
                         f"{local_index} needs devices {wanted.start}..{wanted.stop - 1}")
    return {var: ",".join(visible[i] for i in wanted)}


def launch_ranks(a: Any, role: str) -> int:
    """``a``: the instance's ServeConfig (its flags read as attributes)."""
    mine = local_ranks(a)
    host = a.data_parallel_address or reachable_host(a.host)
    rpc_port = a.data_parallel_rpc_port or free_port(host)
    device = a.device  # resolved by the engine roles' config before ranks are launched
    logs = Path(tempfile.mkdtemp(prefix=f"pdmesh-{role}-dp-"))
    ranks: list[Service] = []
    with ServiceHost(HostSettings(role, a.host)) as launcher:
        try:
            for i, r in enumerate(mine):
                env = device_env(device, i, max(1, a.tensor_parallel_size))
                ranks.append(Service(role, _rank_args(a, r, i, host, rpc_port), logs,
                                     env=env, wait=False, echo=f"[dp{r}] "))
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


def _rank_args(a: Any, rank: int, local_index: int, host: str, rpc_port: int) -> list[str]:
    args = [*sys.argv[1:], "--data-parallel-rank", str(rank), "--data-parallel-address",
            host, "--data-parallel-rpc-port", str(rpc_port)]
    if a.port:
        args += ["--port", str(a.port + local_index)]
    if a.metrics_port > 0:
        args += ["--metrics-port", str(a.metrics_port + local_index)]
    return args


def _stop_ranks(ranks: list[Service], shutdown_timeout_s: float) -> None:
    # all at once: they agree to stop at the next step; they drain first
    stop_together(ranks, timeout_s=shutdown_timeout_s + 10)


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

