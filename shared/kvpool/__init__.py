"""The KV pool: content-addressed KV blocks shared by prefill and decode instances.

Backends behind :class:`KVPool`: :class:`MooncakePool` (a Mooncake Store cluster) and
:class:`InProcessPool` (a dict, for unit tests and single-process use).
"""

from pdmesh.shared.kvpool.base import CacheRegions, KVPool, PoolStats, Region
from pdmesh.shared.kvpool.inprocess import InProcessPool

__all__ = ["CacheRegions", "InProcessPool", "KVPool", "PoolStats", "Region"]
