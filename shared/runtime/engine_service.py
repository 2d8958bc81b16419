"""An engine instance (prefill, decode or mixed) as a service: the engine steps in this
process's main thread, its gRPC edge runs beside it, the ServiceHost does the rest.

    pdmesh decode MODEL --kvstore 127.0.0.1:50100 [--port 0] [engine flags]
      -> the edge process starts (imports, binds) while this one joins the KV pool and
         loads the model -> registered, "decode ready: {json}" -> steps until SIGTERM
         (drain: new requests refused, those in flight finish) -> edge closed, gone

Both roles reach their engine the same way, through an ``EngineClient``: the edge is a
process of its own (``RemoteEngineClient``), so gRPC's Python work never runs between
the engine's steps. With ``PDMESH_ENGINE_EDGE=thread`` (as vLLM's
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) it runs on a thread of this process instead
(``InProcessEngineClient``): one process and one hop fewer, for debugging and for
comparison in benchmarks. ``--data-parallel-size N`` without
``--data-parallel-rank`` starts N rank processes instead (``dp_launcher``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from pdmesh.shared.config.serve import ServeConfig
from pdmesh.shared.engine.config import EngineConfig
from pdmesh.shared.infra import cluster_auth
from pdmesh.shared.infra.registry import Registry
from pdmesh.shared.infra.signals import SignalStop
from pdmesh.shared.infra.tracing import endpoint_from_args
from pdmesh.shared.kvpool.base import KVPool
from pdmesh.shared.proto import kvstore_pb2, kvstore_pb2_grpc
from pdmesh.shared.runtime.edge import EdgeConfig, edge_port, start_edge, stop_edge
from pdmesh.shared.runtime.host import HostSettings, ServiceHost
from pdmesh.shared.runtime.loop import EngineLoop, LocalPort
from pdmesh.shared.runtime.shared_cores import SharedCores

log = logging.getLogger(__name__)

# The engine loop thread runs Python between kernels almost without pause; at the
# default 5 ms GIL switch interval another thread holding a finished token waits up to
# that long to send it. 0.2 ms keeps token latency near the step time.
SWITCH_INTERVAL_S = 0.0002

AddServicer = Callable[[Any, Any, EdgeConfig], None]  # (grpc server, EngineClient, config)


@dataclass(frozen=True)
class EngineRole:
    """What differs between the engine services."""

    name: str  # prefill | decode | mixed
    add_servicer: AddServicer  # the role's gRPC servicer over an EngineClient
    edge_module: str  # `python -m` this to run the edge process (calls serve_edge)


def serve_engine(cfg: ServeConfig, role: EngineRole) -> int:
    """``cfg``: the instance's resolved ServeConfig (its EngineConfig in ``cfg.engine``)."""
    if cfg.data_parallel_size > 1 and cfg.data_parallel_rank is None:
        from pdmesh.shared.runtime.dp_launcher import launch_ranks

        return launch_ranks(cfg, role.name)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    settings = host_settings(cfg, role.name)
    edge_config = EdgeConfig(role.name, cfg.host, cfg.port, cfg.model_name,
                             endpoint_from_args(cfg), cfg.log_level, cfg.log_format,
                             model_path=os.path.abspath(cfg.model or ""),
                             runner="pooling" if cfg.engine.pools else "generate")
    with ServiceHost(settings) as host:
        # started first: the edge imports and binds while this process loads the model
        edge = None if edge_on_thread() else start_edge(role.edge_module, edge_config)
        try:
            return _run(cfg, role, host, edge, edge_config)
        finally:
            if edge is not None:
                stop_edge(*edge)


def host_settings(cfg: ServeConfig, role: str) -> HostSettings:
    """Where the service listens and registers, from its flags."""
    return HostSettings(role, cfg.host, cfg.port, cfg.advertise_host, cfg.redis_url,
                        cfg.registry_prefix, getattr(cfg, "metrics_port", -1),
                        cfg.model_name, cfg.metrics_names)


def _run(cfg: ServeConfig, role: EngineRole, host: ServiceHost, edge,
         edge_config: EdgeConfig) -> int:
    """Join the pool, load the engine, connect its edge, announce it, step."""
    from pdmesh.shared.engine.build import build_engine

    pool = None
    if wants_pool(role.name, cfg.engine):
        pool = connect_pool(cfg, host.settings.reach, host.signals)
        if pool is None:
            return 0  # stopped before a kvstore came
        host.at_close(pool.close)
    engine = build_engine(cfg.engine, kv_pool=pool, save_prompts=role.name == "prefill")
    if role.name == "decode":  # prompts it computes itself come in chunks its streams bear
        engine.chunk_step_ms = cfg.decode_tpot_slo_ms
    if role.name in ("prefill", "decode") and not engine.lockstep and engine.pooling is None:
        engine.measure_step_costs()  # (routers price prompts by them from the first on)
    host.at_close(engine.close)  # (its tensor-parallel ranks, once drained)
    eplb = _rank_eplb(cfg, role.name, engine, host.id)
    if edge is not None:
        loop = EngineLoop(engine, edge[1], eplb)
        host.adopt_port(edge_port(*edge))
    else:
        port = LocalPort()
        loop = EngineLoop(engine, port, eplb)
        host.aio_grpc_server(lambda server, aio: _add_inprocess(role, server, port, aio,
                                                                edge_config))
    if role.name in ("prefill", "decode"):  # beside each other on one box (`pdmesh up`)
        loop.cores, loop.cores_role = SharedCores.from_env(), role.name
    _announce(cfg, role.name, host, loop, eplb)
    loop.run()  # the engine steps in the main thread until drained or stopped
    return 0


def _announce(cfg: ServeConfig, role: str, host: ServiceHost, loop: EngineLoop,
              eplb) -> None:
    """Signals, metrics, the registry entry and the ready line."""
    # SIGTERM / SIGINT: new requests refused, those in flight finish up to
    # --shutdown-timeout; a second signal stops at once (the handler sets flags only)
    host.on_signal = lambda _: loop.drain(cfg.shutdown_timeout)
    loop.on_drain = lambda: _draining(host, role, cfg.shutdown_timeout)
    _serve_metrics(host, loop, eplb, cfg)
    engine = loop.engine
    dp = cfg.data_parallel_size
    group = f"{role}@{cfg.engine.data_parallel_address}" if dp > 1 else ""
    host.register(load=lambda: loop.load().registry_fields(),
                  adapters=None if engine.lora is None else engine.lora.held, dp_size=dp,
                  dp_rank=cfg.data_parallel_rank or 0, group=group,
                  runner="pooling" if engine.pooling is not None else "generate")
    host.ready(model=host.settings.model_name, device=engine.device,
               dp_rank=cfg.data_parallel_rank or 0, kv_blocks=engine.kv.num_blocks,
               kv_bytes_per_token=engine.kv_bytes_per_token,
               kv_role=cfg.kv_role, inactive_keys=list(cfg.additional_config.inactive_keys),
               config=asdict(cfg.engine))


def edge_on_thread() -> bool:
    """PDMESH_ENGINE_EDGE: "process" (the default) or "thread"."""
    placement = os.environ.get("PDMESH_ENGINE_EDGE", "process")
    if placement not in ("process", "thread"):
        raise ValueError(f"PDMESH_ENGINE_EDGE: must be process or thread, got {placement!r}")
    return placement == "thread"


def _add_inprocess(role: EngineRole, server, port: LocalPort, aio, edge_config) -> None:
    from pdmesh.shared.runtime.client import InProcessEngineClient

    role.add_servicer(server, InProcessEngineClient(port, aio), edge_config)


def _draining(host: ServiceHost, role: str, timeout_s: float) -> None:
    """Marked draining in the registry at once, so routers send nothing new."""
    host.mark_draining()
    log.warning("%s: draining (up to %.0f s for requests in flight)", role, timeout_s)


def _serve_metrics(host: ServiceHost, loop: EngineLoop, eplb, a) -> None:
    from pdmesh.shared.infra.metrics import WorkerRequestMetrics, worker_metrics

    if a.metrics_port < 0:
        return
    labels = {"model_name": host.settings.model_name, "instance": host.id, "role":
              host.settings.role, "dp_rank": str(a.data_parallel_rank or 0)}
    per_request = WorkerRequestMetrics(labels)
    loop.on_finished = per_request.finished
    host.serve_metrics(worker_metrics(loop, labels, eplb), per_request.registry)


def _rank_eplb(a: ServeConfig, role: str, engine, instance: str):
    """The rank's side of dynamic EPLB (expert-parallel ranks with load recording). The
    controller places experts over the expert-parallel ranks, DP x TP of them (each DP
    rank reports for its TP ranks, which see its tokens); the group is the DP ranks'
    address, or with one DP rank the instance."""
    config = engine.config
    if engine.ep is None or engine.model.load_recorder is None:
        return None
    from pdmesh.shared.parallel.eplb_rank import ControllerFinder, RankEplb

    group = config.data_parallel_address if config.data_parallel_size > 1 else instance
    finder = ControllerFinder(Registry(a.redis_url, a.registry_prefix), f"{role}@{group}",
                              engine.ep.rank, engine.ep.world, engine.ep.num_slots,
                              a.eplb_address, policy=config.eplb_policy_type)
    return RankEplb(engine.ep, engine.model.load_recorder, finder,
                    record_path=config.expert_map_record_path,
                    series=config.eplb_policy_type == 3,  # FlashLB decides on the steps
                    cadence=eplb_cadence(config, len(engine.ep.placements)))


def eplb_cadence(config, num_moe_layers: int):
    """The step-driven rounds the instance's EPLB flags ask for (None: the timer's)."""
    from pdmesh.shared.parallel.eplb_rank import Cadence

    if config.eplb_rounds == "vllm-ascend":
        return Cadence(config.expert_load_window, hold=config.eplb_algorithm_steps,
                       move=num_moe_layers, recorded=True)
    if config.eplb_rounds == "vllm":  # (its counter starts three quarters in)
        every = config.eplb_step_interval
        return Cadence(every, first=max(1, every // 4))
    return None


def wants_pool(role: str, engine: EngineConfig) -> bool:
    """Prefill and decode instances join the mesh's KV pool; a mixed one only as its KV
    tiers' storage (--hicache-storage-backend mooncake)."""
    tiers = engine.kv_tiers
    return role != "mixed" or (tiers is not None and tiers.storage == "mooncake")


def connect_pool(cfg: ServeConfig, host: str, stop: SignalStop) -> KVPool | None:
    """Ask the kvstore where its Mooncake master is, join the pool, and follow the
    master should it come back elsewhere (the kvstore at ``--kvstore``, or any kvstore
    the registry lists, says where). Without ``--kvstore`` (vLLM's and SGLang's PD lines
    name none) the registry's kvstore, waited for as long as the ready timeout; None:
    ``stop`` came first."""
    from pdmesh.shared.infra.launcher import ready_timeout_s
    from pdmesh.shared.kvpool.following import FollowingPool
    from pdmesh.shared.kvpool.mooncake import MooncakePool

    resolve = MasterFinder(cfg.kvstore, cfg.redis_url, cfg.registry_prefix)
    first = resolve()
    if first is None and not cfg.kvstore:
        timeout_s = ready_timeout_s()
        log.warning("no --kvstore and none in the registry yet (%s, prefix %r): waiting up "
                    "to %.0f s for one", cfg.redis_url, cfg.registry_prefix, timeout_s)
        deadline = time.monotonic() + timeout_s
        while first is None and time.monotonic() < deadline:
            if stop.wait(0.5):
                return None
            first = resolve()
    if first is None:
        where = (f"at {cfg.kvstore} (nor any the registry lists)" if cfg.kvstore else
                 f"in the registry ({cfg.redis_url}, prefix {cfg.registry_prefix!r})")
        raise ConnectionError(f"--kvstore: no kvstore answers {where}")

    def connect(master: tuple[str, str]) -> KVPool:
        return MooncakePool(*master, local_hostname=host,
                            segment_bytes=cfg.pool_segment_mb << 20)

    return FollowingPool(connect(first), connect, resolve)


class MasterFinder:
    """Where the Mooncake master is now: the Stats of the kvstore at ``address`` (if one
    is given), else of the kvstores in the registry (the most recently heard first)."""

    def __init__(self, address: str | None, redis_url: str, prefix: str,
                 timeout_s: float = 2.0):
        self.address = address
        self.redis_url = redis_url
        self.prefix = prefix
        self.timeout_s = timeout_s
        self._registry = None

    def __call__(self) -> tuple[str, str] | None:
        for address in [*filter(None, [self.address]), *self._registered()]:
            found = self._ask(address)
            if found is not None:
                return found
        return None

    def _registered(self) -> list[str]:
        try:
            if self._registry is None:
                self._registry = Registry(self.redis_url, self.prefix)
            stores = self._registry.instances(role="kvstore")
        except Exception as e:  # noqa: BLE001 (no registry: only the flag's address)
            log.debug("kvstore lookup in the registry failed: %s", e)
            return []
        stores.sort(key=lambda i: -i.heartbeat)
        return [i.address for i in stores if i.address != self.address and not i.draining]

    def _ask(self, address: str) -> tuple[str, str] | None:
        channel = cluster_auth.channel(address)
        try:
            stats = kvstore_pb2_grpc.KVStoreStub(channel).Stats(
                kvstore_pb2.StatsRequest(), timeout=self.timeout_s)
        except grpc.RpcError as e:
            log.debug("kvstore %s: no answer (%s)", address, e.code().name)
            return None
        finally:
            channel.close()
        if not stats.master_address:
            return None
        return stats.master_address, stats.metadata_url
