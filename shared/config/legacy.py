"""Old spellings that still reach ``--additional-config``: moved keys, removed keys and the
environment variables vLLM-Ascend is migrating to additional-config (PR #9064).

Precedence, high to low: the key at its current path > its deprecated top-level spelling >
its environment variable > the default. Every use of an old spelling is a warning that
names the new one; ``pdmesh.shared.config.migrate`` applies these tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdmesh.shared.config.options import option

# Top-level keys moved under scheduler_config (additional_config.md "scheduler_config";
# vLLM-Ascend SchedulerConfig.from_additional_config also moves batch_job_sched_config).
MOVED_KEYS: dict[str, str] = {
    "enable_balance_scheduling": "scheduler_config.enable_balance_scheduling",
    "recompute_scheduler_enable": "scheduler_config.recompute_scheduler_enable",
    "short_request_first_config": "scheduler_config.short_request_first_config",
    "profiling_chunk_config": "scheduler_config.profiling_chunk_config",
    "batch_job_sched_config": "scheduler_config.batch_job_sched_config",
    "enable_npugraph_ex": "ascend_compilation_config.enable_npugraph_ex",
}


@dataclass(frozen=True)
class TorchairGraphConfig:
    """The removed ``torchair_graph_config`` (vLLM-Ascend <= v0.11), checked but unused."""

    enabled: bool = option(False, "Torchair graph mode.")
    mode: str | None = option(None, "Torchair mode, e.g. reduce-overhead.")
    enable_multistream_mla: bool = option(False, "MLA vector ops on a second stream.")
    enable_multistream_moe: bool = option(False, "MoE on a second stream.")
    enable_super_kernel: bool = option(False, "Super kernel fusion.")
    enable_view_optimize: bool = option(True, "View optimisation.")
    enable_frozen_parameter: bool = option(True, "Freeze weight addresses.")
    use_cached_graph: bool = option(False, "Reuse cached graphs.")
    graph_batch_sizes: tuple[int, ...] = option((), "Graph batch sizes.")
    graph_batch_sizes_init: bool = option(False, "Pick graph batch sizes at start.")
    enable_kv_nz: bool = option(False, "KV cache NZ layout.")


@dataclass(frozen=True)
class RemovedKey:
    """A key vLLM-Ascend no longer reads: accepted, type-checked, ignored with a warning."""

    expected: Any  # the type its value must still have (a schema dataclass for objects)
    hint: str


_ANY_OBJECT = dict[str, Any]
REMOVED_KEYS: dict[str, RemovedKey] = {
    "torchair_graph_config": RemovedKey(
        TorchairGraphConfig, "torchair graph mode was replaced by ACL graph; use "
        "--compilation-config '{\"cudagraph_mode\": \"FULL_DECODE_ONLY\"}' and "
        "ascend_compilation_config"),
    "ascend_scheduler_config": RemovedKey(
        _ANY_OBJECT, "use vLLM's scheduler flags and scheduler_config"),
    "enable_weight_nz_layout": RemovedKey(
        bool, "use weight_nz_mode (0 off, 1 quantized weights, 2 all weights)"),
    "chunked_prefill_for_mla": RemovedKey(bool, "no replacement; chunked prefill is the default"),
    "enable_sparse_c8": RemovedKey(bool, "use enable_sparse_sfa_c8 and enable_sparse_li_c8"),
    "enable_sleep_mode_extra_cleanup": RemovedKey(
        bool, "use rl_config: {\"enabled\": true, \"sleep_mode_extra_cleanup\": true}"),
    "kvpp_size": RemovedKey(int, "use enable_kvpp: true (the KVPP size is the TP size)"),
    "enable_prefetch": RemovedKey(bool, "use weight_prefetch_config.enabled"),
    "kv_cache_dtype": RemovedKey(str, "use vLLM's --kv-cache-dtype"),
    "expert_map_path": RemovedKey(str, "use eplb_config.expert_map_path"),
    "dynamic_eplb": RemovedKey(bool, "use eplb_config.dynamic_eplb"),
    "num_iterations_eplb_update": RemovedKey(
        int, "use eplb_config.expert_heat_collection_interval"),
    "gate_eplb": RemovedKey(bool, "no replacement"),
    "num_wait_worker_iterations": RemovedKey(int, "use eplb_config.algorithm_execution_interval"),
    "init_redundancy_expert": RemovedKey(int, "use eplb_config.num_redundant_experts"),
    "lmhead_tensor_parallel_size": RemovedKey(
        int, "use finegrained_tp_config.lmhead_tensor_parallel_size"),
    "oproj_tensor_parallel_size": RemovedKey(
        int, "use finegrained_tp_config.oproj_tensor_parallel_size"),
}


def _env_bool(text: str) -> bool:
    """vLLM-Ascend reads these as bool(int(x)) or x.lower() in ("1", "true")."""
    lowered = text.strip().lower()
    if lowered in ("1", "true"):
        return True
    if lowered in ("0", "false"):
        return False
    raise ValueError("expected 0, 1, true or false")


def _env_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError("expected an integer") from None


@dataclass(frozen=True)
class EnvVar:
    """An environment variable that still sets an additional-config key."""

    key: str  # the dotted path it sets
    parse: Callable[[str], Any]


# additional_config.md "Migration Guide / Quick Reference", plus DYNAMIC_EPLB (envs.py;
# EPLB feature guide: "export DYNAMIC_EPLB=true" to enable dynamic EPLB on Model Runner V1).
ENV_VARS: dict[str, EnvVar] = {
    "VLLM_ASCEND_BALANCE_SCHEDULING": EnvVar("scheduler_config.enable_balance_scheduling",
                                             _env_bool),
    "VLLM_ASCEND_ENABLE_FLASHCOMM1": EnvVar("enable_flashcomm1", _env_bool),
    "VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE": EnvVar("enable_matmul_allreduce", _env_bool),
    "VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE": EnvVar("flashcomm2_parallel_size", _env_int),
    "MSMONITOR_USE_DAEMON": EnvVar("msmonitor_use_daemon", _env_bool),
    "VLLM_ASCEND_ENABLE_MLAPO": EnvVar("enable_mlapo", _env_bool),
    "VLLM_ASCEND_ENABLE_NZ": EnvVar("weight_nz_mode", _env_int),
    "VLLM_ASCEND_ENABLE_CONTEXT_PARALLEL": EnvVar("enable_context_parallel", _env_bool),
    "VLLM_ASCEND_ENABLE_FUSED_MC2": EnvVar("enable_fused_mc2", _env_int),
    "VLLM_ASCEND_FUSION_OP_TRANSPOSE_KV_CACHE_BY_BLOCK": EnvVar(
        "enable_transpose_kv_cache_by_block", _env_bool),
    "DYNAMIC_EPLB": EnvVar("eplb_config.dynamic_eplb", _env_bool),
}

# Read by parse_additional_config when EngineArgs.model_runner_v2 is None.
MODEL_RUNNER_V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"
