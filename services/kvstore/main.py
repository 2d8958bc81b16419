"""`pdmesh kvstore`: the Mooncake master under supervision plus the pool index over gRPC.

    pdmesh kvstore --host 127.0.0.1 --port 50100 [--master-port P --metadata-port H]

Ports left at 0 are chosen free. The line ``kvstore ready: {json}`` on stdout tells a
launcher where everything listens.
"""

from __future__ import annotations

import argparse
import json
import logging
from concurrent import futures

import grpc

from pdmesh.services.kvstore.index import PoolIndex
from pdmesh.services.kvstore.server import KVStoreServicer
from pdmesh.shared.infra.registry import (
    Heartbeat,
    Instance,
    Registry,
    add_registry_args,
    advertised_host,
)
from pdmesh.shared.infra.signals import SignalStop
from pdmesh.shared.kvpool.master import EvictionPolicy, MasterPorts, MasterSupervisor, free_port
from pdmesh.shared.kvpool.mooncake import MooncakePool
from pdmesh.shared.proto import kvstore_pb2_grpc

log = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free one)")
    p.add_argument("--master-port", type=int, default=0)
    p.add_argument("--metadata-port", type=int, default=0)
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--master-log", default=None)
    ev = EvictionPolicy()
    p.add_argument("--kv-lease-ttl-ms", type=int, default=ev.lease_ttl_ms,
                   help="how long a read pins a block against eviction (Mooncake's own "
                        "default, 10 s, lets a burst of prompts fill the pool)")
    p.add_argument("--eviction-high-watermark-ratio", type=float,
                   default=ev.high_watermark_ratio)
    p.add_argument("--eviction-ratio", type=float, default=ev.eviction_ratio)
    add_registry_args(p)


def run(a: argparse.Namespace) -> int:
    eviction = EvictionPolicy(a.kv_lease_ttl_ms, a.eviction_high_watermark_ratio,
                              a.eviction_ratio)
    host = advertised_host(a.host, a.advertise_host)
    ports = MasterPorts(a.host, a.master_port or free_port(a.host),
                        a.metadata_port or free_port(a.host), a.metrics_port or free_port(a.host),
                        advertise=host)
    supervisor = MasterSupervisor(ports, log_path=a.master_log, eviction=eviction)
    supervisor.start()
    server = None
    pool = None
    try:
        pool = MooncakePool(ports.master_address, ports.metadata_url, local_hostname=host,
                            segment_bytes=16 << 20, local_buffer_bytes=16 << 20)
        index = PoolIndex(pool, supervisor.metrics)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(KVStoreServicer(index, supervisor), server)
        port = server.add_insecure_port(f"{a.host}:{a.port}")
        server.start()
        inst = Instance(Heartbeat.new_id("kvstore"), "kvstore", f"{host}:{port}")
        beat = Heartbeat(Registry(a.redis_url, a.registry_prefix), inst)
        beat.start()
        print("kvstore ready: " + json.dumps({
            "grpc": f"{host}:{port}", "master": ports.master_address,
            "metadata": ports.metadata_url, "master_pid": supervisor.pid}), flush=True)
        SignalStop().install().wait()
        beat.stop()
    finally:
        if server is not None:
            server.stop(grace=2).wait()
        if pool is not None:
            pool.close()
        supervisor.stop()
    return 0
