"""The KV tiers a command line asks for (engine/kv_tiers.py): SGLang's HiCache flags
(``--enable-hierarchical-cache``, ``--hicache-size`` GB or ``--hicache-ratio`` of the
device cache, ``--hicache-write-policy``, ``--hicache-storage-backend`` file | mooncake,
``--hicache-storage-prefetch-policy``) and vLLM's ``--kv-offloading-size`` GiB with
``--kv-offloading-backend native``, as a TierConfig (None: no tiers)."""

from __future__ import annotations

import os
from typing import Any

from pdmesh.shared.engine.kv_tiers import TierConfig

GB = 10**9  # (SGLang's --hicache-size is in GB, vLLM's --kv-offloading-size in GiB)
GIB = 1 << 30
# SGLang's file backend's directory (its environment variable, its default)
FILE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"


def tier_config(f: Any) -> TierConfig | None:
    """ValueError naming the flag for a value the tiers cannot take."""
    offload = getattr(f, "kv_offloading_size", None)
    if not (getattr(f, "enable_hierarchical_cache", False) or offload):
        return None
    backend = getattr(f, "kv_offloading_backend", None) or "native"
    if backend != "native":
        raise ValueError(f"--kv-offloading-backend: pdmesh's tiers are its own (native); "
                         f"{backend} is not bound")
    size = getattr(f, "hicache_size", 0) or 0
    if size < 0 or (offload is not None and offload < 0):
        raise ValueError("--hicache-size: must be >= 0 (0: --hicache-ratio decides)")
    host = int(size * GB) if size else (int(offload * GIB) if offload else None)
    storage = getattr(f, "hicache_storage_backend", None) or None
    config = TierConfig(host_bytes=host, host_ratio=getattr(f, "hicache_ratio", 2.0),
                        write_policy=getattr(f, "hicache_write_policy", "write_through"),
                        storage=storage,
                        storage_dir=os.environ.get(FILE_DIR_ENV) or "/tmp/hicache",
                        prefetch_policy=getattr(f, "hicache_storage_prefetch_policy",
                                                "best_effort"))
    config.validate()
    return config


# the companions of the switch (given without it: said without effect)
COMPANIONS = ("--hicache-ratio", "--hicache-size", "--hicache-write-policy",
              "--hicache-storage-backend", "--hicache-storage-prefetch-policy")


def idle_tier_flags(f: Any) -> tuple[str, ...]:
    """The tier flags given without the tiers on: each said without effect."""
    from pdmesh.shared.config.flags import FLAGS  # (flags.py reaches this module)

    if getattr(f, "enable_hierarchical_cache", False) or getattr(f, "kv_offloading_size", None):
        return ()
    idle = [flag.name for flag in FLAGS if flag.name in COMPANIONS
            and getattr(f, flag.attr, flag.default) not in (flag.default, None)]
    return (f"{', '.join(idle)}: without effect (the KV tiers are off: "
            "--enable-hierarchical-cache or --kv-offloading-size turns them on)",) if idle else ()


def idle_pool_flags(f: Any, role: str, tiers: TierConfig | None) -> tuple[str, ...]:
    """The KV pool's flags given to a mixed instance that has no use for them: it joins a
    pool only as its tiers' Mooncake storage, and reads one only with tiers."""
    if role != "mixed":
        return ()
    given = set(getattr(f, "given", ()))
    mooncake = tiers is not None and tiers.storage == "mooncake"
    idle = [name for name in ("--kvstore", "--pool-segment-mb")
            if name in given and not mooncake]
    if "--kv-load-timeout" in given and tiers is None:
        idle.append("--kv-load-timeout")
    return (f"{', '.join(idle)}: without effect on a mixed instance (it joins a KV pool "
            "only for --hicache-storage-backend mooncake, and reads one only with the KV "
            "tiers)",) if idle else ()
