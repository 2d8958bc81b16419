"""The environment variables vLLM / vLLM-Ascend recipes export, and what pdmesh makes of
each: read by pdmesh (with what effect), read by the runtime pdmesh runs on (CANN, HCCL,
torch, OpenMP: passed through), always on here, or without effect (and why).

Every start-up and ``pdmesh config check`` say which of those set are without effect
(``environment_warnings``); an unknown ``VLLM_*`` variable is named too, since pdmesh
reads only the ones below. Sources: vLLM's and vLLM-Ascend's ``envs.py`` and their
history (a variable a release removed is read by neither any more), the seeds' recipes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdmesh.shared.config.legacy import ENV_VARS, MODEL_RUNNER_V2_ENV
from pdmesh.shared.infra.timeouts import collective_timeout_s, rpc_timeout_s

READ = "read"  # pdmesh reads it: ``note`` says what it does
RUNTIME = "runtime"  # read by a library in the same process (CANN, HCCL, torch, OpenMP)
ALWAYS = "always"  # what it turns on, pdmesh always does
NONE = "none"  # without effect: ``note`` says why


@dataclass(frozen=True)
class EnvVar:
    verdict: str
    note: str


# (the additional-config keys' variables, ENV_VARS in legacy.py, are read there)
KNOWN: dict[str, EnvVar] = {
    # -- read by pdmesh ------------------------------------------------------------------
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": EnvVar(
        READ, "how long a rank's collectives wait for the other ranks of a step (tensor, "
        "expert and fine-grained parallelism) before the step fails; default 120 s"),
    "VLLM_RPC_TIMEOUT": EnvVar(
        READ, "milliseconds the gateway waits on an instance: a prefill call, or a "
        "decode stream's silence; default 600000"),
    "VLLM_ENGINE_READY_TIMEOUT_S": EnvVar(READ, "how long start-up waits for an engine"),
    "VLLM_LOG_STATS_INTERVAL": EnvVar(
        READ, "seconds between an engine's stats lines (default 10; --disable-log-stats: "
        "none)"),
    "VLLM_API_KEY": EnvVar(READ, "the gateway's API key, as --api-key"),
    MODEL_RUNNER_V2_ENV: EnvVar(READ, "which additional-config fields EPLB accepts"),
    # -- always so here -----------------------------------------------------------------
    "VLLM_ASCEND_APPLY_DSV4_PATCH": EnvVar(
        ALWAYS, "vLLM-Ascend's DeepSeek-V4 patches (a KV cache coordinator for several "
        "cache groups, its speculative config): pdmesh's DeepSeek-V4 keeps its window "
        "and compressed caches as groups of its own"),
    "USE_MULTI_GROUPS_KV_CACHE": EnvVar(
        ALWAYS, "several KV cache groups (DeepSeek-V4's hybrid cache) are how pdmesh "
        "always keeps them; vLLM-Ascend does not read it as a variable either"),
    "USE_MULTI_BLOCK_POOL": EnvVar(
        ALWAYS, "one block pool per KV cache group is how pdmesh always keeps them; "
        "vLLM-Ascend does not read it as a variable either"),
    "VLLM_USE_V1": EnvVar(ALWAYS, "pdmesh's engine is vLLM V1's design"),
    # -- without effect ------------------------------------------------------------------
    "VLLM_ASCEND_ENABLE_FLASHCOMM": EnvVar(
        NONE, "renamed VLLM_ASCEND_ENABLE_FLASHCOMM1 in vLLM-Ascend 0.11 (#3334), which "
        "reads only the new name; set that one"),
    "VLLM_ASCEND_ENABLE_PREFETCH_MLP": EnvVar(
        NONE, "dropped by vLLM-Ascend (#7357); use --additional-config "
        "weight_prefetch_config"),
    "VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE": EnvVar(
        NONE, "removed by vLLM-Ascend (#5272); its dense-model paths are always on "
        "there, and pdmesh has no other"),
    "VLLM_VERSION": EnvVar(NONE, "a version pin for vLLM-Ascend's own build; pdmesh has "
                                 "its own version"),
    "TP_SOCKET_IFNAME": EnvVar(
        NONE, "TensorPipe's interface (torch RPC), which pdmesh does not use; its "
        "collectives bind the address they are given"),
    # -- read by the runtime -------------------------------------------------------------
    **{name: EnvVar(RUNTIME, "read by CANN / HCCL on an Ascend NPU")
       for name in ("HCCL_BUFFSIZE", "HCCL_OP_EXPANSION_MODE", "HCCL_CONNECT_TIMEOUT",
                    "HCCL_EXEC_TIMEOUT", "HCCL_IF_IP", "HCCL_SOCKET_IFNAME",
                    "HCCL_DETERMINISTIC", "ASCEND_RT_VISIBLE_DEVICES",
                    "ASCEND_TRANSFER_TIMEOUT", "ASCEND_CONNECT_TIMEOUT",
                    "ASCEND_LAUNCH_BLOCKING")},
    "TASK_QUEUE_ENABLE": EnvVar(RUNTIME, "read by torch_npu (its task queue)"),
    "PYTORCH_NPU_ALLOC_CONF": EnvVar(RUNTIME, "read by torch_npu's allocator"),
    "GLOO_SOCKET_IFNAME": EnvVar(RUNTIME, "read by gloo (the CPU side of collectives)"),
    "OMP_NUM_THREADS": EnvVar(RUNTIME, "read by torch / OpenMP"),
    "OMP_PROC_BIND": EnvVar(RUNTIME, "read by OpenMP"),
    "LD_PRELOAD": EnvVar(RUNTIME, "read by the dynamic loader (jemalloc, in the recipes)"),
    "LD_LIBRARY_PATH": EnvVar(RUNTIME, "read by the dynamic loader"),
}


def verdict(name: str) -> EnvVar | None:
    """What pdmesh makes of environment variable ``name`` (None: not a vLLM / SGLang /
    Ascend variable pdmesh knows of, and not vLLM's)."""
    if name in KNOWN:
        return KNOWN[name]
    if name in ENV_VARS:
        return EnvVar(READ, f"sets --additional-config {ENV_VARS[name].key}")
    if name.startswith(("VLLM_", "SGLANG_", "SGL_")):
        return EnvVar(NONE, "not read by pdmesh")
    return None


def environment_warnings(env: Mapping[str, str]) -> list[str]:
    """What start-up says of the variables set in ``env``: those without effect, by name
    and reason; a bad value of one pdmesh reads is a ValueError naming it."""
    rpc_timeout_s(env)
    collective_timeout_s(env)
    out = []
    if env.get("VLLM_USE_V1", "1").strip().lower() in ("0", "false"):
        out.append("environment variable VLLM_USE_V1: without effect (pdmesh's engine is "
                   "vLLM V1's design; there is no V0 engine to choose)")
    for name in sorted(env):
        v = verdict(name)
        if v is not None and v.verdict == NONE:
            out.append(f"environment variable {name}: without effect ({v.note})")
    return out


__all__ = ["KNOWN", "collective_timeout_s", "environment_warnings", "rpc_timeout_s", "verdict"]
