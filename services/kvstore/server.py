"""kvstore's gRPC edge: decode the request, call the index, encode the answer."""

from __future__ import annotations

import logging

import grpc

from pdmesh.services.kvstore.index import PoolIndex
from pdmesh.shared.kvpool.master import MasterSupervisor
from pdmesh.shared.kvpool.mooncake import PoolUnavailable
from pdmesh.shared.proto import common_pb2, kvstore_pb2, kvstore_pb2_grpc

log = logging.getLogger(__name__)

MAX_LOOKUP_KEYS = 65536


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, index: PoolIndex, supervisor: MasterSupervisor | None):
        self.index = index
        self.supervisor = supervisor

    def Lookup(self, request, context):  # noqa: N802 (gRPC method name)
        keys = list(request.keys)
        if len(keys) > MAX_LOOKUP_KEYS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"keys: {len(keys)} given, at most {MAX_LOOKUP_KEYS} per lookup")
        try:
            found, prefix = self.index.lookup(keys)
        except PoolUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return kvstore_pb2.LookupResponse(exists=found, prefix_hits=prefix)

    def Stats(self, request, context):  # noqa: N802
        s = self.index.stats()
        sup = self.supervisor
        return kvstore_pb2.StatsResponse(
            keys=s.keys, bytes=s.bytes, hits=s.hits, misses=s.misses,
            master_address=sup.ports.master_address if sup else "",
            metadata_url=sup.ports.metadata_url if sup else "",
            master_restarts=sup.restarts if sup else 0)

    def Clear(self, request, context):  # noqa: N802
        try:
            return kvstore_pb2.ClearResponse(removed=self.index.clear())
        except PoolUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    def Health(self, request, context):  # noqa: N802
        return common_pb2.HealthResponse(serving=True, role="kvstore")
