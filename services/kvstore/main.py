"""`pdmesh kvstore`: the Mooncake master under supervision plus the pool index over gRPC.

    pdmesh kvstore --host 127.0.0.1 --port 50100 [--master-port P --metadata-port H]

Ports left at 0 are chosen free. The line ``kvstore ready: {json}`` on stdout tells a
launcher where everything listens.
"""

from __future__ import annotations

import logging

from pdmesh.services.kvstore.index import PoolIndex
from pdmesh.services.kvstore.server import KVStoreServicer
from pdmesh.shared.config.serve import ServeConfig
from pdmesh.shared.kvpool.master import EvictionPolicy, MasterPorts, MasterSupervisor
from pdmesh.shared.kvpool.mooncake import MooncakePool
from pdmesh.shared.proto import kvstore_pb2_grpc
from pdmesh.shared.runtime.host import HostSettings, ServiceHost

log = logging.getLogger(__name__)


def run(a: ServeConfig) -> int:
    eviction = EvictionPolicy(a.kv_lease_ttl_ms, a.eviction_high_watermark_ratio,
                              a.eviction_ratio)
    settings = HostSettings("kvstore", a.host, a.port, a.advertise_host, a.redis_url,
                            a.registry_prefix)  # (--metrics-port is the master's)
    with ServiceHost(settings) as host:
        supervisor = MasterSupervisor(
            MasterPorts(a.host, a.master_port, a.metadata_port, a.metrics_port,
                        advertise=settings.reach),
            log_path=a.master_log, eviction=eviction)
        supervisor.start()
        ports = supervisor.ports
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
