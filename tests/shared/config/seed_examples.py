"""Every ``--additional-config`` value and JSON example in the four seed documents.

Extracted by hand from ``../shared/seeds/`` (relative to the repository). Each case keeps
the text exactly as the document writes it (a JSON string from a command line, or a Python
dict from an offline ``LLM(...)`` example) with the engine flags and environment of the
command it came from, so that the cross-key rules see what the recipe really runs.

``sglang-ascend-server-args.zh.txt`` has no additional-config at all; its only braces are
flag defaults ("{}") and a schema sketch that is not JSON, listed in ``NOT_JSON``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdmesh.shared.config import EngineArgs

AC = "additional-config.zh.txt"
FEATURES = "vllm-ascend-features.zh.txt"
DSV4 = "dsv4-deployment.zh.txt"
SGLANG = "sglang-ascend-server-args.zh.txt"


@dataclass(frozen=True)
class SeedCase:
    name: str
    source: str  # "file:line" of the value in shared/seeds/
    raw: str | dict[str, Any]
    engine: EngineArgs = field(default_factory=EngineArgs)
    env: dict[str, str] = field(default_factory=dict)
    kv_transfer_config: str | None = None  # the recipe's --kv-transfer-config, verbatim
    # Placeholders are not real keys: strict parsing must reject them, naming these keys.
    rejected_keys: tuple[str, ...] = ()
    verbatim: bool = True  # False: written from prose, not copied from a code block


# The DeepSeek-V4 recipes' environment variables (dsv4-deployment.zh.txt lines 8-20,
# 115-117, 256-267); only the ones the parser reads matter, the rest must be ignored.
_DSV4_SINGLE_ENV = {
    "OMP_PROC_BIND": "false", "OMP_NUM_THREADS": "10", "VLLM_USE_V1": "1",
    "VLLM_VERSION": "0.18.0", "USE_MULTI_BLOCK_POOL": "1", "USE_MULTI_GROUPS_KV_CACHE": "1",
    "HCCL_BUFFSIZE": "1024", "VLLM_ASCEND_ENABLE_FUSED_MC2": "1",
    "VLLM_ASCEND_ENABLE_FLASHCOMM1": "1", "DYNAMIC_EPLB": "true",
    "VLLM_ENGINE_READY_TIMEOUT_S": "1200",
}
_DSV4_MULTI_ENV = {"HCCL_OP_EXPANSION_MODE": "AIV", "TASK_QUEUE_ENABLE": "1",
                   "VLLM_ASCEND_APPLY_DSV4_PATCH": "1", "VLLM_ASCEND_ENABLE_FLASHCOMM1": "1"}
_DSV4_P_ENV = {"HCCL_OP_EXPANSION_MODE": "AIV", "VLLM_ASCEND_ENABLE_FUSED_MC2": "1",
               "VLLM_ASCEND_ENABLE_FLASHCOMM1": "1", "VLLM_ASCEND_APPLY_DSV4_PATCH": "1"}
_DSV4_D_ENV = {"HCCL_OP_EXPANSION_MODE": "AIV", "TASK_QUEUE_ENABLE": "1",
               "VLLM_ASCEND_APPLY_DSV4_PATCH": "1"}

_DSV4_MULTI_NODE = (
    "\n"
    '    {"ascend_compilation_config":{\n'
    '        "enable_npugraph_ex":true,\n'
    '        "enable_static_kernel":false\n'
    "        },\n"
    '    "enable_cpu_binding": "true",\n'
    '    "multistream_overlap_shared_expert":true}'
)

SEED_CASES: tuple[SeedCase, ...] = (
    # additional-config.zh.txt line 23: the "how to use" placeholder (online).
    SeedCase("ac_placeholder_online", f"{AC}:23", '{"config_key":"config_value"}',
             rejected_keys=("config_key",)),
    # additional-config.zh.txt line 29: the same placeholder (offline, a Python dict).
    SeedCase("ac_placeholder_offline", f"{AC}:29", {"config_key": "config_value"},
             rejected_keys=("config_key",)),
    # additional-config.zh.txt line 99: RL mode, same-device.
    SeedCase("ac_rl_same_device", f"{AC}:99",
             '{"rl_config": {"enabled": true, "enable_training_consistency": true, '
             '"enable_batch_invariant": true, "sleep_mode_extra_cleanup": true}}'),
    # additional-config.zh.txt line 105: RL mode, cross-device.
    SeedCase("ac_rl_cross_device", f"{AC}:105", '{"rl_config": {"enabled": true}}'),
    # additional-config.zh.txt lines 114-120: RL mode, offline (a Python dict).
    SeedCase("ac_rl_offline", f"{AC}:114", {
        "rl_config": {
            "enabled": True,
            "enable_training_consistency": True,
            "enable_batch_invariant": True,
        },
    }),
    # additional-config.zh.txt lines 129-153: the full example (a Python dict). It has no
    # command line; its o_proj TP of 8 needs a decode node with tensor_parallel_size 1,
    # graph mode and data_parallel_size divisible by 8, and dynamic_spec_config needs a
    # "dspark" speculative config, so that is the engine it is checked against.
    SeedCase("ac_full_example", f"{AC}:129", {
        "finegrained_tp_config": {
            "lmhead_tensor_parallel_size": 8,
            "oproj_tensor_parallel_size": 8,
            "embedding_tensor_parallel_size": 8,
            "mlp_tensor_parallel_size": 8,
        },
        "enable_kv_nz": False,
        "multistream_overlap_shared_expert": True,
        "rejection_sampler_config": {
            "enable_block_verify": True,
            "enable_entropy_verify": True,
            "posterior_threshold": 0.95,
            "posterior_alpha": 0.4,
        },
        "dynamic_spec_config": {
            "method": "dspark",
            "method_params": {
                "initial_verify_budget_per_req": 5,
                "budget_update_interval": 50,
                "budget_threshold": 0.7,
            },
        },
        "refresh": False
    }, engine=EngineArgs(kv_role="kv_consumer", data_parallel_size=8, tensor_parallel_size=1,
                         enable_expert_parallel=True, speculative_method="dspark")),
    # additional-config.zh.txt line 157: "在 --additional-config 中设置 enable_kvpp: true"
    # (prose; KVPP needs eager mode and no KV connector, line 159; "TP4 + PCP2" example).
    SeedCase("ac_kvpp", f"{AC}:157", '{"enable_kvpp": true}',
             engine=EngineArgs(tensor_parallel_size=4, prefill_context_parallel_size=2,
                               enforce_eager=True, model_runner_v2=True), verbatim=False),
    # vllm-ascend-features.zh.txt line 137: Weight NZ (a removed key).
    SeedCase("features_weight_nz", f"{FEATURES}:137", '{"enable_weight_nz_layout":true}'),
    # vllm-ascend-features.zh.txt line 263: Torchair graph mode (removed keys), TP16 + EP.
    SeedCase("features_torchair", f"{FEATURES}:263",
             '{"torchair_graph_config":{"enabled":true,"enable_multistream_moe":true,'
             '"enable_super_kernel":true,"use_cached_graph":true,"enable_multistream_mla":true,'
             '"graph_batch_sizes":[16]},"chunked_prefill_for_mla":true,'
             '"enable_weight_nz_layout":true}',
             engine=EngineArgs(tensor_parallel_size=16, enable_expert_parallel=True,
                               speculative_method="deepseek_mtp")),
    # dsv4-deployment.zh.txt lines 46-53: single-node mixed DeepSeek-V4-Flash, DP2 TP8 EP.
    SeedCase("dsv4_single_node", f"{DSV4}:46",
             "\n"
             '    {"ascend_compilation_config":{\n'
             '        "enable_npugraph_ex":true,\n'
             '        "enable_static_kernel":false\n'
             "        },\n"
             '    "enable_cpu_binding": "true",\n'
             '    "multistream_overlap_shared_expert":false,\n'
             '    "multistream_dsa_preprocess":false}',
             engine=EngineArgs(data_parallel_size=2, tensor_parallel_size=8,
                               enable_expert_parallel=True, speculative_method="deepseek_mtp"),
             env=_DSV4_SINGLE_ENV),
    # dsv4-deployment.zh.txt lines 155-161: multi-node mixed, master node, DP2 (1 local).
    SeedCase("dsv4_multi_node_master", f"{DSV4}:155", _DSV4_MULTI_NODE,
             engine=EngineArgs(data_parallel_size=2, data_parallel_size_local=1,
                               tensor_parallel_size=16, enable_expert_parallel=True,
                               speculative_method="mtp"),
             env=_DSV4_MULTI_ENV),
    # dsv4-deployment.zh.txt lines 222-228: multi-node mixed, worker node (same value).
    SeedCase("dsv4_multi_node_worker", f"{DSV4}:222", _DSV4_MULTI_NODE,
             engine=EngineArgs(data_parallel_size=2, data_parallel_size_local=1,
                               tensor_parallel_size=16, enable_expert_parallel=True,
                               speculative_method="mtp"),
             env=_DSV4_MULTI_ENV),
    # dsv4-deployment.zh.txt line 313: PD-disaggregated prefill node (eager, DP2 TP16).
    SeedCase("dsv4_pd_prefill", f"{DSV4}:313",
             '{"enable_cpu_binding": "True", "enable_dsa_cp": true}',
             engine=EngineArgs(kv_role="kv_producer", data_parallel_size=2,
                               tensor_parallel_size=16, enable_expert_parallel=True,
                               enforce_eager=True, speculative_method="mtp"),
             env=_DSV4_P_ENV,
             kv_transfer_config=(
                 '{"kv_connector": "MooncakeHybridConnector",\n'
                 '  "kv_role": "kv_producer",\n'
                 '  "kv_port": "30000",\n'
                 '  "engine_id": "0",\n'
                 '  "kv_connector_extra_config": {\n'
                 '              "prefill": {\n'
                 '                      "dp_size": 2,\n'
                 '                      "tp_size": 16\n'
                 "              },\n"
                 '              "decode": {\n'
                 '                      "dp_size": 16,\n'
                 '                      "tp_size": 2\n'
                 "              }\n"
                 "      }\n"
                 "  }")),
    # dsv4-deployment.zh.txt lines 420-428: PD-disaggregated decode node (DP16 TP2), with
    # the deprecated top-level recompute_scheduler_enable.
    SeedCase("dsv4_pd_decode", f"{DSV4}:420",
             "{\n"
             '        "ascend_compilation_config":{\n'
             '              "enable_npugraph_ex":true,\n'
             '              "enable_static_kernel":false\n'
             "        },\n"
             '       "enable_cpu_binding":true,\n'
             '       "multistream_overlap_shared_expert":false,\n'
             '       "recompute_scheduler_enable":true\n'
             "    }",
             engine=EngineArgs(kv_role="kv_consumer", data_parallel_size=16,
                               tensor_parallel_size=2, enable_expert_parallel=True,
                               speculative_method="mtp"),
             env=_DSV4_D_ENV,
             kv_transfer_config=(
                 '{"kv_connector": "MooncakeHybridConnector",\n'
                 '    "kv_role": "kv_consumer",\n'
                 '    "kv_port": "30300",\n'
                 '    "engine_id": "3",\n'
                 '    "kv_connector_extra_config": {\n'
                 '                "prefill": {\n'
                 '                        "dp_size": 2,\n'
                 '                        "tp_size": 16\n'
                 "                },\n"
                 '                "decode": {\n'
                 '                        "dp_size": 16,\n'
                 '                        "tp_size": 2\n'
                 "                }\n"
                 "        }\n"
                 "    }")),
)

# The other JSON-valued flags of the seed recipes: not additional-config, but every one
# must still be valid JSON (they are what EngineArgs above was read from).
_SPEC_MTP_EAGER = '{"num_speculative_tokens": 1,"method": "mtp","enforce_eager": true}'
_SPEC_MTP_EAGER_PD = '{"num_speculative_tokens": 1, "method":"mtp", "enforce_eager": true}'
_LOADER = '{"enable_multithread_load": "true", "num_threads": 128}'


def _mooncake_v1(role: str, port: str, engine_id: str, rank: int) -> str:
    """vllm-ascend-features.zh.txt lines 187-206 (prefill) and 222-241 (decode)."""
    return ('{"kv_connector": "MooncakeConnectorV1",\n'
            '  "kv_buffer_device": "npu",\n'
            f'  "kv_role": "{role}",\n'
            '  "kv_parallel_size": 1,\n'
            f'  "kv_port": "{port}",\n'
            f'  "engine_id": "{engine_id}",\n'
            f'  "kv_rank": {rank},\n'
            '  "kv_connector_module_path": "vllm_ascend.distributed.mooncake_connector",\n'
            '  "kv_connector_extra_config": {\n'
            '            "prefill": {\n'
            '                    "dp_size": 2,\n'
            '                    "tp_size": 2\n'
            "             },\n"
            '             "decode": {\n'
            '                    "dp_size": 2,\n'
            '                    "tp_size": 2\n'
            "             }\n"
            "      }\n"
            "  }")


OTHER_JSON: tuple[tuple[str, str, str], ...] = (
    (f"{AC}:91", "--weight-transfer-config", '{"backend": "nccl"}'),
    (f"{AC}:98", "--weight-transfer-config", '{"backend": "ipc"}'),
    (f"{AC}:104", "--weight-transfer-config", '{"backend": "nccl"}'),
    (f"{FEATURES}:187", "--kv-transfer-config", _mooncake_v1("kv_producer", "20001", "0", 0)),
    (f"{FEATURES}:222", "--kv-transfer-config", _mooncake_v1("kv_consumer", "20002", "1", 1)),
    (f"{FEATURES}:259", "--speculative-config",
     '{"num_speculative_tokens":2, "method":"deepseek_mtp"}'),
    (f"{DSV4}:42", "--speculative-config",
     '{"num_speculative_tokens": 1,"method": "deepseek_mtp"}'),
    (f"{DSV4}:44", "--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY"}'),
    (f"{DSV4}:132", "--model-loader-extra-config", _LOADER),
    (f"{DSV4}:148", "--compilation-config", '{"cudagraph_mode":"FULL_DECODE_ONLY"}'),
    (f"{DSV4}:153", "--speculative-config", _SPEC_MTP_EAGER),
    (f"{DSV4}:199", "--model-loader-extra-config", _LOADER),
    (f"{DSV4}:216", "--compilation-config", '{"cudagraph_mode":"FULL_DECODE_ONLY"}'),
    (f"{DSV4}:221", "--speculative-config", _SPEC_MTP_EAGER),
    (f"{DSV4}:306", "--model-loader-extra-config", _LOADER),
    (f"{DSV4}:312", "--speculative-config", _SPEC_MTP_EAGER_PD),
    (f"{DSV4}:398", "--model-loader-extra-config", _LOADER),
    (f"{DSV4}:402", "--speculative-config", _SPEC_MTP_EAGER_PD),
    (f"{DSV4}:403", "--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY"}'),
    (f"{SGLANG}:19", "--model-loader-extra-config", "{}"),
    (f"{SGLANG}:76", "--mm-process-config", "{}"),
    (f"{SGLANG}:135", "--json-model-override-args", "{}"),
)

# Braces in the seeds that are not JSON at all (a type sketch, a Python-ish dict).
NOT_JSON: tuple[tuple[str, str], ...] = (
    (f"{SGLANG}:144", '{"lora_name": str, "lora_path": str, "pinned": bool}'),
    (f"{SGLANG}:90", "{‘label1’: ‘value1’, ‘label2’: ‘value2’}"),
)
