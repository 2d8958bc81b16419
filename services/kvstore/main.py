"""`pdmesh kvstore`: the Mooncake master under supervision plus the pool index over gRPC.

    pdmesh kvstore --host 127.0.0.1 --port 50100 [--master-port P --metadata-port H]

Ports left at 0 are chosen free. The line ``kvstore ready: {json}`` on stdout tells a
launcher where everything listens.
"""

from __future__ import annotations

import argparse
import logging

from pdmesh.services.kvstore.index import PoolIndex
from pdmesh.services.kvstore.server import KVStoreServicer
from pdmesh.shared.infra.net import free_port
from pdmesh.shared.infra.registry import add_registry_args
from pdmesh.shared.kvpool.master import EvictionPolicy, MasterPorts, MasterSupervisor
from pdmesh.shared.kvpool.mooncake import MooncakePool
from pdmesh.shared.proto import kvstore_pb2_grpc
from pdmesh.shared.runtime.host import HostSettings, ServiceHost

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
    settings = HostSettings("kvstore", a.host, a.port, a.advertise_host, a.redis_url,
                            a.registry_prefix)
    with ServiceHost(settings) as host:
        ports = MasterPorts(a.host, a.master_port or free_port(a.host),
                            a.metadata_port or free_port(a.host),
                            a.metrics_port or free_port(a.host), advertise=settings.reach)
        supervisor = MasterSupervisor(ports, log_path=a.master_log, eviction=eviction)
        supervisor.start()
        host.at_close(supervisor.stop)
        pool = MooncakePool(ports.master_address, ports.metadata_url,
                            local_hostname=settings.reach, segment_bytes=16 << 20,
                            local_buffer_bytes=16 << 20)
        host.at_close(pool.close)
        index = PoolIndex(pool, supervisor.metrics)
        host.grpc_server(lambda server: kvstore_pb2_grpc.add_KVStoreServicer_to_server(
            KVStoreServicer(index, supervisor), server))
        host.register()
        host.ready(master=ports.master_address, metadata=ports.metadata_url,
                   master_pid=supervisor.pid)
        host.wait()
    return 0
