"""The engine flags that decide which additional-config keys may be combined.

Spelled as ``vllm serve`` spells them; ``kv_role`` comes from ``--kv-transfer-config``.
Only what the cross-key rules in ``pdmesh.shared.config.rules`` read is here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
SCHEDULING_POLICIES = ("fcfs", "priority", "lpm", "lof", "random")


@dataclass(frozen=True)
class EngineArgs:
    """Engine flags the additional-config rules look at.

    ``kv_role`` None means no ``--kv-transfer-config``: a PD-mixed instance, as is
    ``kv_both``. ``model_runner_v2`` None means "read VLLM_USE_V2_MODEL_RUNNER".
    """

    kv_role: str | None = None
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None  # None: every DP rank on this node
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    enable_expert_parallel: bool = False
    enable_eplb: bool = False  # upstream --enable-eplb
    eplb_config: Mapping[str, Any] = field(default_factory=dict)  # upstream --eplb-config
    scheduling_policy: str = "fcfs"
    enforce_eager: bool = False
    speculative_method: str | None = None  # --speculative-config method, None: no drafting
    model_runner_v2: bool | None = None

    def __post_init__(self) -> None:
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role: must be one of {', '.join(KV_ROLES)} or None, "
                             f"got {self.kv_role!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: must be one of "
                             f"{', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")
        for name in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size",
                     "prefill_context_parallel_size", "decode_context_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.data_parallel_size_local is not None and not (
                1 <= self.data_parallel_size_local <= self.data_parallel_size):
            raise ValueError(f"data_parallel_size_local: must be in [1, data_parallel_size], "
                             f"got {self.data_parallel_size_local}")

    @property
    def uses_upstream_eplb(self) -> bool:
        """Whether upstream EPLB is asked for (``--enable-eplb`` or ``--eplb-config``)."""
        return self.enable_eplb or bool(self.eplb_config)

    @property
    def is_decode_node(self) -> bool:
        return self.kv_role == "kv_consumer"

    @property
    def is_prefill_node(self) -> bool:
        return self.kv_role == "kv_producer"

    @property
    def is_pd_mixed(self) -> bool:
        return self.kv_role in (None, "kv_both")
