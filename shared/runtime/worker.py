"""Start-up shared by the engine services (prefill, decode): flags, the KV pool, the
engine loop, the gRPC server, and the ready line a launcher waits for.

    pdmesh prefill --model M --kvstore 127.0.0.1:50100 [--port 0] [engine flags]
    -> stdout: "prefill ready: {"grpc": "127.0.0.1:PORT", ...}"
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict

import grpc

from pdmesh.shared.config.service import add_service_args, resolve_service_config
from pdmesh.shared.engine.args import add_engine_args, engine_config_from_args
from pdmesh.shared.engine.engine import EngineCore
from pdmesh.shared.infra.registry import (
    Heartbeat,
    Instance,
    Registry,
    add_registry_args,
    advertised_host,
)
from pdmesh.shared.infra.signals import SignalStop
from pdmesh.shared.infra.tracing import Tracing, add_tracing_args, endpoint_from_args
from pdmesh.shared.kernels import resolve_device
from pdmesh.shared.kvpool.base import KVPool
from pdmesh.shared.proto import kvstore_pb2, kvstore_pb2_grpc
from pdmesh.shared.runtime.edge import EdgeConfig, edge_port, start_edge, stop_edge
from pdmesh.shared.runtime.loop import EngineLoop

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0002


def add_worker_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free one)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--kvstore", default=None,
                   help="the kvstore service's gRPC address (prefill and decode need one; "
                        "a mixed instance runs without a pool)")
    p.add_argument("--pool-segment-mb", type=int, default=512,
                   help="memory this instance lends to the KV pool")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="refuse a request (gRPC RESOURCE_EXHAUSTED) while this many wait "
                        "to run on this instance (default: no limit)")
    g = p.add_argument_group("data parallel ranks (vllm serve flags)")
    g.add_argument("--data-parallel-rank", type=int, default=None,
                   help="run as this one rank of a data-parallel instance (the instance's "
                        "launcher sets it; without it, --data-parallel-size N starts N ranks)")
    g.add_argument("--data-parallel-address", default=None,
                   help="host of rank 0's process-group store (default: --host)")
    g.add_argument("--data-parallel-rpc-port", type=int, default=None,
                   help="port of rank 0's process-group store (default: a free one)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds requests in flight get to finish")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="HTTP port of /metrics (0: any free one; -1: none)")
    g.add_argument("--eplb-address", default=None,
                   help="the EPLB controller's gRPC address, with dynamic EPLB (default: the "
                        "one in the registry)")
    add_registry_args(p)
    add_tracing_args(p)
    add_service_args(p)


def connect_pool(kvstore: str, host: str, segment_mb: int) -> KVPool:
    """Ask the kvstore where its Mooncake master is, then join the pool."""
    from pdmesh.shared.kvpool.mooncake import MooncakePool

    stub = kvstore_pb2_grpc.KVStoreStub(grpc.insecure_channel(kvstore))
    try:
        stats = stub.Stats(kvstore_pb2.StatsRequest(), timeout=10)
    except grpc.RpcError as e:
        raise ConnectionError(f"kvstore: no answer from {kvstore} ({e.code().name})") from e
    return MooncakePool(stats.master_address, stats.metadata_url, local_hostname=host,
                        segment_bytes=segment_mb << 20)


def serve_worker(a: argparse.Namespace, role: str,
                 add_servicer: Callable[[grpc.aio.Server, EngineLoop, str, Tracing], None],
                 edge_module: str | None = None) -> int:
    """``edge_module``: serve gRPC from a separate process running that module
    (shared.runtime.edge), not from a thread of this one. PDMESH_INPROCESS_GRPC=1 keeps it here
    (``add_servicer``), for comparison."""
    # every flag checked before anything heavy starts
    device = resolve_device(a.device)
    service = resolve_service_config(a, role, device)
    scheduling = scheduling_settings(a, service)
    if a.data_parallel_size > 1 and a.data_parallel_rank is None:
        return launch_ranks(a, role)
    # The engine loop thread runs Python between kernels almost without pause; at the
    # default 5 ms GIL switch interval a gRPC thread holding a finished token waits up to
    # that long to send it. 0.2 ms keeps token latency near the step time.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    host = advertised_host(a.host, a.advertise_host)
    model_name = a.served_model_name or a.model
    edge = None
    if edge_module is not None and os.environ.get("PDMESH_INPROCESS_GRPC") != "1":
        # started first: it imports and binds while this process loads the model; it
        # traces the requests (this process has no spans of its own)
        edge = start_edge(edge_module, EdgeConfig(
            role, a.host, a.port, model_name, endpoint_from_args(a), a.log_level,
            a.log_format))
    tracing = Tracing.from_args(f"pdmesh-{role}", a) if edge is None else \
        Tracing(f"pdmesh-{role}", None)
    pool = None
    if role != "mixed":
        if not a.kvstore:
            raise ValueError(f"--kvstore: a {role} instance needs the kvstore's address")
        pool = connect_pool(a.kvstore, host, a.pool_segment_mb)
    config = dataclasses.replace(engine_config_from_args(a), **parallel_settings(a, service),
                                 **scheduling, **serving_defaults(a, device))
    sched = service.additional.scheduler_config
    if sched.dyntra_lb_config.enabled:
        config = dataclasses.replace(config, dyntra_lb=sched.dyntra_lb_config)
    if sched.recompute_scheduler_enable and role == "decode":  # (a warning elsewhere)
        config = dataclasses.replace(config, recompute_scheduler=True)
    engine = EngineCore(config, kv_pool=pool, save_prompts=role == "prefill")
    eplb = None
    if engine.ep is not None and engine.model.load_recorder is not None:
        from pdmesh.shared.parallel.eplb_rank import ControllerFinder, RankEplb

        finder = ControllerFinder(Registry(a.redis_url, a.registry_prefix),
                                  f"{role}@{config.data_parallel_address}",
                                  config.data_parallel_rank, config.data_parallel_size,
                                  engine.ep.num_slots, a.eplb_address)
        eplb = RankEplb(engine.ep, engine.model.load_recorder, finder,
                        record_path=config.expert_map_record_path)
    loop = EngineLoop(engine, eplb)
    if edge is not None:
        port = edge_port(*edge)
        loop.attach_link(edge[1])
    else:
        # gRPC runs on an asyncio loop in one thread; the engine steps in the main thread
        aio = asyncio.new_event_loop()
        threading.Thread(target=aio.run_forever, name="grpc-aio", daemon=True).start()

        async def start_server() -> tuple[grpc.aio.Server, int]:
            server = grpc.aio.server()
            add_servicer(server, loop, model_name, tracing)
            port = server.add_insecure_port(f"{a.host}:{a.port}")
            await server.start()
            return server, port

        server, port = asyncio.run_coroutine_threadsafe(start_server(), aio).result(30)
    inst = Instance(Heartbeat.new_id(role), role, f"{host}:{port}", model_name,
                    dp_size=a.data_parallel_size, dp_rank=a.data_parallel_rank or 0,
                    group=(f"{role}@{config.data_parallel_address}"
                           if a.data_parallel_size > 1 else ""))
    beat_box: list[Heartbeat] = []

    def draining() -> None:
        """Marked draining in the registry at once, so routers send nothing new."""
        if beat_box:
            threading.Thread(target=beat_box[0].mark_draining, daemon=True).start()
        log.warning("%s: draining (up to %.0f s for requests in flight)", role,
                    a.shutdown_timeout)

    # SIGTERM / SIGINT: new requests refused, those in flight finish up to
    # --shutdown-timeout; a second signal stops at once. The handler only sets the
    # loop's flags (pdmesh.shared.infra.signals); the loop calls ``draining`` when it notices.
    SignalStop(on_signal=lambda _: loop.drain(a.shutdown_timeout)).install()
    loop.on_drain = draining
    metrics_port = None
    if a.metrics_port >= 0:
        from pdmesh.shared.infra.metrics import WorkerRequestMetrics, serve_metrics, worker_metrics

        labels = {"model_name": model_name, "instance": inst.id, "role": role,
                  "dp_rank": str(inst.dp_rank)}
        per_request = WorkerRequestMetrics(labels)
        loop.on_finished = per_request.finished
        metrics_port = serve_metrics(worker_metrics(loop, labels, eplb), a.host,
                                     a.metrics_port, per_request.registry)
    beat = Heartbeat(Registry(a.redis_url, a.registry_prefix), inst,
                     load=lambda: asdict(loop.load()))
    beat.start()
    beat_box.append(beat)
    print(f"{role} ready: " + json.dumps({
        "grpc": f"{host}:{port}", "model": model_name, "device": engine.device,
        "id": inst.id, "dp_rank": inst.dp_rank, "kv_blocks": engine.kv.num_blocks,
        "metrics": f"http://{host}:{metrics_port}/metrics" if metrics_port else None,
 "kv_role": service.kv_role,
        "inactive_keys": list(service.additional.inactive_keys), "config": asdict(config)}),
        flush=True)
    try:
        loop.run()  # the engine steps in the main thread until a signal stops it
    finally:
        beat.stop()
        if edge is not None:
            stop_edge(*edge)
        else:
            asyncio.run_coroutine_threadsafe(server.stop(grace=5), aio).result(10)
            aio.call_soon_threadsafe(aio.stop)
        if pool is not None:
            pool.close()
        tracing.shutdown()  # flushes spans not yet exported
    return 0


# vLLM's defaults for `vllm serve` on CPU (the offline LLM keeps the larger ones)
CPU_SERVING_MAX_NUM_BATCHED_TOKENS = 2048


def serving_defaults(a: argparse.Namespace, device: str) -> dict:
    """EngineConfig fields whose default differs when serving, as in vLLM: on CPU a step
    computes at most 2,048 tokens unless --max-num-batched-tokens says otherwise, so a
    burst of prompts is prefilled in chunks and the first ones answer early, not all
    together after one long step."""
    if a.max_num_batched_tokens is None and device == "cpu":
        return {"max_num_batched_tokens": CPU_SERVING_MAX_NUM_BATCHED_TOKENS}
    return {}


def parallel_settings(a: argparse.Namespace, service) -> dict:
    """EngineConfig fields for data / expert parallelism and EPLB, from the flags and
    ``eplb_config`` (vLLM-Ascend's fields) or upstream ``--eplb-config``."""
    if a.data_parallel_size == 1:
        return {}
    eplb = service.additional.eplb_config
    upstream = service.engine_args.eplb_config if service.engine_args.enable_eplb else {}
    dynamic = eplb.dynamic_eplb or service.engine_args.enable_eplb
    if upstream:
        window = int(upstream.get("window_size", 1000))
        redundant = int(upstream.get("num_redundant_experts", 0))
        phase = eplb.load_collection_phase
    else:
        window = eplb.expert_heat_collection_interval
        redundant = eplb.num_redundant_experts
        phase = eplb.eplb_heat_collection_stage
    host = a.data_parallel_address or ("127.0.0.1" if a.host in ("0.0.0.0", "::") else a.host)
    return {"data_parallel_size": a.data_parallel_size,
            "data_parallel_rank": a.data_parallel_rank or 0,
            "data_parallel_address": f"{host}:{a.data_parallel_rpc_port}",
            "enable_expert_parallel": a.enable_expert_parallel,
            "num_redundant_experts": redundant if a.enable_expert_parallel else 0,
            "expert_map_path": eplb.expert_map_path if a.enable_expert_parallel else None,
            "expert_map_record_path": (eplb.expert_map_record_path
                                       if a.enable_expert_parallel else None),
            "expert_load_window": max(window, 1) if dynamic else 0,
            "expert_load_phase": phase}


def scheduling_settings(a: argparse.Namespace, service) -> dict:
    """EngineConfig fields for the waiting queue: the policy (priority from either flag
    family, as ``resolve_service_config`` resolved it; ShortRequestFirst from
    ``scheduler_config.short_request_first_config``, which the config rules allow only
    on prefill and mixed instances with FCFS) and ``--max-queued-requests``."""
    if a.max_queued_requests is not None and a.max_queued_requests < 1:
        raise ValueError(f"--max-queued-requests: must be >= 1, got {a.max_queued_requests}")
    srf = service.additional.scheduler_config.short_request_first_config
    fields = {"scheduling_policy": service.engine_args.scheduling_policy,
              "priority_low_values_first": service.priority_low_values_first,
              "max_queued_requests": a.max_queued_requests}
    if srf.enabled:
        fields.update(scheduling_policy="short_request_first",
                      short_request_threshold=srf.threshold,
                      short_request_long_max_wait_ms=srf.long_max_wait_ms)
    return fields


def launch_ranks(a: argparse.Namespace, role: str) -> int:
    """``--data-parallel-size N`` without a rank: start the N rank processes (each a full
    instance with its own gRPC port and registry entry, joined by one process group),
    print one ready line for them all, and stop them all on SIGTERM / SIGINT or when one
    dies."""
    import os
    import sys
    import tempfile
    import time
    from pathlib import Path

    from pdmesh.shared.infra.launcher import Service
    from pdmesh.shared.kvpool.master import free_port

    host = a.data_parallel_address or ("127.0.0.1" if a.host in ("0.0.0.0", "::") else a.host)
    rpc_port = a.data_parallel_rpc_port or free_port(host)
    argv = list(sys.argv[1:])
    logs = Path(tempfile.mkdtemp(prefix=f"pdmesh-{role}-dp-"))
    ranks: list[Service] = []
    stop = SignalStop().install()
    try:
        for r in range(a.data_parallel_size):
            args = [*argv, "--data-parallel-rank", str(r), "--data-parallel-address", host,
                    "--data-parallel-rpc-port", str(rpc_port)]
            if a.port:
                args += ["--port", str(a.port + r)]
            if a.metrics_port > 0:
                args += ["--metrics-port", str(a.metrics_port + r)]
            ranks.append(Service(role, args, logs, wait=False, echo=f"[dp{r}] "))
        _wait_for_ranks(ranks, timeout_s=300)
        print(f"{role} ready: " + json.dumps({
            "grpc": ranks[0].address, "ranks": [s.address for s in ranks],
            "dp_size": a.data_parallel_size, "pids": [s.proc.pid for s in ranks],
            "eplb_group": f"{role}@{host}:{rpc_port}",
            "metrics": [s.info.get("metrics") for s in ranks],
            "logs": str(logs), "model": ranks[0].info.get("model")}), flush=True)
        while not stop.wait(0.5):
            dead = [i for i, s in enumerate(ranks) if s.proc.poll() is not None]
            if dead:
                log.error("%s: rank(s) %s exited; stopping the instance", role, dead)
                return 1
        return 0
    finally:
        for svc in ranks:  # SIGTERM to all at once: they agree to stop at the next step
            if svc.proc.poll() is None:
                os.killpg(svc.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + a.shutdown_timeout + 10  # the ranks drain first
        for svc in ranks:
            svc.stop(timeout_s=max(0.1, deadline - time.monotonic()))


def _wait_for_ranks(ranks, timeout_s: float) -> None:
    """Until every rank is ready; the first rank to exit before that ends the wait with
    its own error (the others would wait for it in the process group until timeout)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not all(s.info for s in ranks):
        for r, s in enumerate(ranks):
            if not s.info and s.proc.poll() is not None:
                s.join_output()
                lines = [ln for ln in s.log_path.read_text().splitlines() if ln.strip()]
                errors = [ln for ln in lines if ln.startswith("pdmesh: error: ")]
                why = errors[-1].removeprefix("pdmesh: error: ") if errors else \
                    (lines[-1] if lines else f"exit status {s.proc.returncode}")
                raise ValueError(f"data parallel rank {r} failed to start: {why}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"data parallel ranks not ready after {timeout_s:.0f} s")
        time.sleep(0.05)
