"""Every ``vllm serve`` command line in the seed documents, copied verbatim.

Copied by hand from ``../shared/seeds/`` (relative to the repository); the tests never read
that folder. Each text runs from ``vllm serve`` to where the shell command ends, backslash
continuations, quotes, comments and trailing pipes included. ``expect`` holds fields of the
parsed ``VllmServeConfig``; ``error`` the text the error must contain instead.

``sglang-ascend-server-args.zh.txt`` is skipped: its command lines are ``sglang`` ones
(``python -m sglang.launch_server``), not ``vllm serve``.
"""

# ruff: noqa: E501  (the seed lines are kept verbatim, long ones included)

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The DeepSeek-V4 PD recipes are scripts run as `script.sh DEVICES PORT DP DP_RANK DP_ADDR
# DP_RPC_PORT TP`; these stand in for $2..$7.
_PD_SCRIPT_ARGS = {"2": "8000", "3": "2", "4": "0", "5": "10.0.0.1", "6": "13399", "7": "16"}


@dataclass(frozen=True)
class SeedCommand:
    name: str
    source: str  # "file:first-last line" in shared/seeds/
    command: str
    expect: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the parse must fail with a message containing this
    variables: dict[str, str] = field(default_factory=dict)


SEED_COMMANDS: tuple[SeedCommand, ...] = (
    SeedCommand(
        "ac_placeholder", "additional-config.zh.txt:23",
        r"""vllm serve Qwen/Qwen3-8B --additional-config='{"config_key":"config_value"}'""",
        expect={"model": "Qwen/Qwen3-8B"},
        error="config_key",
    ),
    SeedCommand(
        "ac_rl_same_device", "additional-config.zh.txt:95-99",
        r"""vllm serve DeepSeek-V4 \
    --enable-sleep-mode \
    --enable-return-routed-experts \
    --weight-transfer-config '{"backend": "ipc"}' \
    --additional-config '{"rl_config": {"enabled": true, "enable_training_consistency": true, "enable_batch_invariant": true, "sleep_mode_extra_cleanup": true}}'""",
        expect={"model": "DeepSeek-V4", "accepted_without_effect": ("--enable-sleep-mode", "--enable-return-routed-experts", "--weight-transfer-config")},
    ),
    SeedCommand(
        "ac_rl_cross_device", "additional-config.zh.txt:103-105",
        r"""vllm serve DeepSeek-V4 \
    --weight-transfer-config '{"backend": "nccl"}' \
    --additional-config '{"rl_config": {"enabled": true}}'""",
        expect={"model": "DeepSeek-V4", "accepted_without_effect": ("--weight-transfer-config",)},
    ),
    SeedCommand(
        "dsv4_single_node", "dsv4-deployment.zh.txt:25-54",
        r"""vllm serve /mnt/share/weights/v4_w8a8 \
    --port 8008 \
    --host 0.0.0.0 \
    --max_model_len 10240 \
    --max-num-batched-tokens 10240 \
    --served-model-name dsv4 \
    --gpu-memory-utilization 0.9 \
    --max-num-seqs 64 \
    --data-parallel-size 2 \
    --tensor-parallel-size 8 \
    --enable-expert-parallel \
    --tokenizer-mode deepseek_v4 \
    --tool-call-parser deepseek_v4 \
    --enable-auto-tool-choice \
    --reasoning-parser deepseek_v4 \
    --safetensors-load-strategy 'prefetch' \
    --quantization ascend \
    --speculative-config '{"num_speculative_tokens": 1,"method": "deepseek_mtp"}' \
    --block-size 128 \
    --compilation-config '{"cudagraph_mode": "FULL_DECODE_ONLY"}'\
    --async-scheduling \
    --additional-config '
    {"ascend_compilation_config":{
        "enable_npugraph_ex":true,
        "enable_static_kernel":false
        },
    "enable_cpu_binding": "true",
    "multistream_overlap_shared_expert":false,
    "multistream_dsa_preprocess":false}' \
    2>&1 | tee single.log""",
        expect={"model": "/mnt/share/weights/v4_w8a8", "port": 8008, "host": "0.0.0.0", "max_model_len": 10240, "max_num_batched_tokens": 10240, "served_model_name": ("dsv4",), "max_num_seqs": 64, "data_parallel_size": 2, "tensor_parallel_size": 8, "enable_expert_parallel": True, "block_size": 128},
    ),
    SeedCommand(
        "dsv4_two_node_master", "dsv4-deployment.zh.txt:128-161",
        r"""vllm serve /mnt/share/weights/DeepSeek-V4-Pro-w4a8-fixmtp \
  --port 8900 \
  --host 0.0.0.0 \
  --safetensors-load-strategy 'prefetch' \
  --model-loader-extra-config='{"enable_multithread_load": "true", "num_threads": 128}' \
  --max_model_len 135000  \
  --max-num-batched-tokens 4096 \
  --served-model-name dsv4 \
  --gpu-memory-utilization 0.9 \
  --max-num-seqs 16 \
  --data-parallel-size 2 \
  --data-parallel-size-local 1 \
  --data-parallel-start-rank 0 \
  --data-parallel-address xxx.xxx.xxx.xxx \
  --data-parallel-rpc-port 13399 \
  --tensor-parallel-size 16 \
  --enable-expert-parallel \
  --quantization ascend \
  --block-size 128 \
  --async-scheduling \
  --compilation-config '{"cudagraph_mode":"FULL_DECODE_ONLY"}' \
  --tokenizer-mode deepseek_v4 \
  --tool-call-parser deepseek_v4 \
  --enable-auto-tool-choice \
  --reasoning-parser deepseek_v4 \
  --speculative-config '{"num_speculative_tokens": 1,"method": "mtp","enforce_eager": true}' \
  --api-server-count 1 \
  --additional-config '
    {"ascend_compilation_config":{
        "enable_npugraph_ex":true,
        "enable_static_kernel":false
        },
    "enable_cpu_binding": "true",
    "multistream_overlap_shared_expert":true}'""",
        expect={"max_model_len": 135000, "max_num_batched_tokens": 4096, "data_parallel_size": 2, "data_parallel_size_local": 1, "tensor_parallel_size": 16, "port": 8900},
    ),
    SeedCommand(
        "dsv4_two_node_worker", "dsv4-deployment.zh.txt:195-228",
        r"""vllm serve /mnt/share/weights/DeepSeek-V4-Pro-w4a8-fixmtp \
  --port 8900 \
  --host 0.0.0.0 \
  --safetensors-load-strategy 'prefetch' \
  --model-loader-extra-config='{"enable_multithread_load": "true", "num_threads": 128}' \
  --max_model_len 135000  \
  --max-num-batched-tokens 4096 \
  --served-model-name dsv4 \
  --gpu-memory-utilization 0.9 \
  --max-num-seqs 16 \
  --data-parallel-size 2 \
  --data-parallel-size-local 1 \
  --data-parallel-start-rank 1 \
  --data-parallel-address xxx.xxx.xxx.xxx \
  --headless \
  --data-parallel-rpc-port 13399 \
  --tensor-parallel-size 16 \
  --enable-expert-parallel \
  --quantization ascend \
  --block-size 128 \
  --async-scheduling \
  --compilation-config '{"cudagraph_mode":"FULL_DECODE_ONLY"}' \
  --tokenizer-mode deepseek_v4 \
  --tool-call-parser deepseek_v4 \
  --enable-auto-tool-choice \
  --reasoning-parser deepseek_v4 \
  --speculative-config '{"num_speculative_tokens": 1,"method": "mtp","enforce_eager": true}' \
  --additional-config '
    {"ascend_compilation_config":{
        "enable_npugraph_ex":true,
        "enable_static_kernel":false
        },
    "enable_cpu_binding": "true",
    "multistream_overlap_shared_expert":true}'""",
        expect={"max_model_len": 135000, "data_parallel_size": 2, "tensor_parallel_size": 16, "gpu_memory_utilization": 0.9},
    ),
    SeedCommand(
        "dsv4_pd_prefill", "dsv4-deployment.zh.txt:286-329",
        r"""vllm serve /mnt/share/weights/DeepSeek-V4-Pro-w4a8-fixmtp \
  --host 0.0.0.0 \
  --port $2 \
  --data-parallel-size $3 \
  --data-parallel-rank $4 \
  --data-parallel-address $5 \
  --data-parallel-rpc-port $6 \
  --tensor-parallel-size $7 \
  --enable-expert-parallel \
  --seed 1024 \
  --served-model-name auto \
  --max-model-len 131072 \
  --max-num-batched-tokens 4096 \
  --max-num-seqs 16 \
  --no-disable-hybrid-kv-cache-manager \
  --tokenizer-mode deepseek_v4 \
  --tool-call-parser deepseek_v4 \
  --enable-auto-tool-choice \
  --reasoning-parser deepseek_v4 \
  --safetensors-load-strategy 'prefetch' \
  --model-loader-extra-config='{"enable_multithread_load": "true", "num_threads": 128}' \
  --trust-remote-code \
  --gpu-memory-utilization 0.92 \
  --quantization ascend \
  --block-size 128 \
  --enforce-eager \
  --speculative-config '{"num_speculative_tokens": 1, "method":"mtp", "enforce_eager": true}' \
  --additional-config '{"enable_cpu_binding": "True", "enable_dsa_cp": true}' \
  --kv-transfer-config \
  '{"kv_connector": "MooncakeHybridConnector",
  "kv_role": "kv_producer",
  "kv_port": "30000",
  "engine_id": "0",
  "kv_connector_extra_config": {
              "prefill": {
                      "dp_size": 2,
                      "tp_size": 16
              },
              "decode": {
                      "dp_size": 16,
                      "tp_size": 2
              }
      }
  }'""",
        expect={"port": 8000, "data_parallel_size": 2, "tensor_parallel_size": 16, "seed": 1024, "served_model_name": ("auto",), "max_model_len": 131072, "enforce_eager": True, "gpu_memory_utilization": 0.92},
        variables=_PD_SCRIPT_ARGS,
    ),
    SeedCommand(
        "dsv4_pd_decode", "dsv4-deployment.zh.txt:375-428",
        r"""vllm serve /mnt/share/weights/DeepSeek-V4-Pro-w4a8-fixmtp \
    --host 0.0.0.0 \
    --port $2 \
    --data-parallel-size $3 \
    --data-parallel-rank $4 \
    --data-parallel-address $5 \
    --data-parallel-rpc-port $6 \
    --tensor-parallel-size $7 \
    --enable-expert-parallel \
    --seed 1024 \
    --served-model-name auto \
    --max-model-len 131072 \
    --max-num-batched-tokens 120 \
    --max-num-seqs 60 \
    --async-scheduling \
    --block-size 128 \
    --no-enable-prefix-caching \
    --tokenizer-mode deepseek_v4 \
    --tool-call-parser deepseek_v4 \
    --enable-auto-tool-choice \
    --reasoning-parser deepseek_v4 \
    --no-disable-hybrid-kv-cache-manager \
    --safetensors-load-strategy 'prefetch' \
    --model-loader-extra-config='{"enable_multithread_load": "true", "num_threads": 128}' \
    --trust-remote-code \
    --gpu-memory-utilization 0.9 \
    --quantization ascend \
    --speculative-config '{"num_speculative_tokens": 1, "method":"mtp", "enforce_eager": true}' \
    --compilation-config '{"cudagraph_mode": "FULL_DECODE_ONLY"}' \
    --kv-transfer-config \
    '{"kv_connector": "MooncakeHybridConnector",
    "kv_role": "kv_consumer",
    "kv_port": "30300",
    "engine_id": "3",
    "kv_connector_extra_config": {
                "prefill": {
                        "dp_size": 2,
                        "tp_size": 16
                },
                "decode": {
                        "dp_size": 16,
                        "tp_size": 2
                }
        }
    }' \
    --additional-config '{
        "ascend_compilation_config":{
              "enable_npugraph_ex":true,
              "enable_static_kernel":false
        },
       "enable_cpu_binding":true,
       "multistream_overlap_shared_expert":false,
       "recompute_scheduler_enable":true
    }'""",
        expect={"max_num_batched_tokens": 120, "max_num_seqs": 60, "enable_prefix_caching": False, "enforce_eager": False},
        variables=_PD_SCRIPT_ARGS,
    ),
    SeedCommand(
        "features_enforce_eager", "vllm-ascend-features.zh.txt:51",
        r"""vllm serve Qwen/Qwen2-7B-Instruct --enforce-eager""",
        expect={"model": "Qwen/Qwen2-7B-Instruct", "enforce_eager": True, "accepted_without_effect": ()},
    ),
    SeedCommand(
        "features_quantization", "vllm-ascend-features.zh.txt:83",
        r"""vllm serve /home/models/Qwen3-8B-w4a8 --served-model-name "qwen3-8b-w4a8" --max-model-len 4096 --quantization ascend""",
        expect={"model": "/home/models/Qwen3-8B-w4a8", "served_model_name": ("qwen3-8b-w4a8",), "max_model_len": 4096, "quantization": "ascend", "accepted_without_effect": ()},
    ),
    SeedCommand(
        "features_no_prefix_cache", "vllm-ascend-features.zh.txt:121",
        r"""vllm serve /home/weight/Qwen2.5-32B-Instruct --gpu-memory-utilization 0.9 --tensor-parallel-size 4 --no-enable-prefix-caching # 关闭prefix cache""",
        expect={"gpu_memory_utilization": 0.9, "tensor_parallel_size": 4, "enable_prefix_caching": False},
    ),
    SeedCommand(
        "features_chunked_prefill_typo", "vllm-ascend-features.zh.txt:133",
        r"""vllm serve /home/models/Qwen3-8B-w4a8 --served-model-name "qwen3-8b-w4a8" --max-model-len 4096 ---max-num-batched-tokens 2048""",
        error="did you mean --max-num-batched-tokens",
    ),
    SeedCommand(
        "features_weight_nz", "vllm-ascend-features.zh.txt:137",
        r"""vllm serve /home/models/Qwen3-8B-w4a8 --served-model-name "qwen3-8b-w4a8" --additional-config '{"enable_weight_nz_layout":true}'""",
        expect={"model": "/home/models/Qwen3-8B-w4a8", "served_model_name": ("qwen3-8b-w4a8",)},
    ),
    SeedCommand(
        "features_mooncake_prefill", "vllm-ascend-features.zh.txt:173-205",
        r"""vllm serve "/xxxxx/DeepSeek-V2-Lite-Chat" \
  --host localhost \
  --port 8100 \
  --tensor-parallel-size 2\
  --seed 1024 \
  --max-model-len 2000  \
  --max-num-batched-tokens 2000  \
  --trust-remote-code \
  --enforce-eager \
  --data-parallel-size 2 \
  --data-parallel-address localhost \
  --data-parallel-rpc-port 9100 \
  --gpu-memory-utilization 0.8  \
  --kv-transfer-config  \
  '{"kv_connector": "MooncakeConnectorV1",
  "kv_buffer_device": "npu",
  "kv_role": "kv_producer",
  "kv_parallel_size": 1,
  "kv_port": "20001",
  "engine_id": "0",
  "kv_rank": 0,
  "kv_connector_module_path": "vllm_ascend.distributed.mooncake_connector",
  "kv_connector_extra_config": {
            "prefill": {
                    "dp_size": 2,
                    "tp_size": 2
             },
             "decode": {
                    "dp_size": 2,
                    "tp_size": 2
             }
      }
  }'""",
        expect={"model": "/xxxxx/DeepSeek-V2-Lite-Chat", "host": "localhost", "port": 8100, "tensor_parallel_size": 2, "data_parallel_size": 2, "max_model_len": 2000, "gpu_memory_utilization": 0.8},
    ),
    SeedCommand(
        "features_mooncake_decode", "vllm-ascend-features.zh.txt:208-240",
        r"""vllm serve "/xxxxx/DeepSeek-V2-Lite-Chat" \
  --host localhost \
  --port 8200 \
  --tensor-parallel-size 2\
  --seed 1024 \
  --max-model-len 2000  \
  --max-num-batched-tokens 2000  \
  --trust-remote-code \
  --enforce-eager \
  --data-parallel-size 2 \
  --data-parallel-address localhost \
  --data-parallel-rpc-port 9100 \
  --gpu-memory-utilization 0.8  \
  --kv-transfer-config  \
  '{"kv_connector": "MooncakeConnectorV1",
  "kv_buffer_device": "npu",
  "kv_role": "kv_consumer",
  "kv_parallel_size": 1,
  "kv_port": "20002",
  "engine_id": "1",
  "kv_rank": 1,
  "kv_connector_module_path": "vllm_ascend.distributed.mooncake_connector",
  "kv_connector_extra_config": {
            "prefill": {
                    "dp_size": 2,
                    "tp_size": 2
             },
             "decode": {
                    "dp_size": 2,
                    "tp_size": 2
             }
      }
  }'""",
        expect={"port": 8200, "seed": 1024, "max_num_batched_tokens": 2000, "enforce_eager": True},
    ),
    SeedCommand(
        "features_torchair", "vllm-ascend-features.zh.txt:248-263",
        r"""vllm serve /mnt/share/weight/DeepSeek-R1-0528_w8a8_MTP_float \
 --port 20002 \
 --data-parallel-size 1 \
 --tensor-parallel-size 16 \
 --enable-expert-parallel \
 --seed 1024 \
 --served-model-name dsv3 \
 --max-model-len 5200 \
 --max-num-batched-tokens 2048 \
 --max-num-seqs 16 \
 --quantization ascend \
 --speculative-config '{"num_speculative_tokens":2, "method":"deepseek_mtp"}' \
 --trust-remote-code \
 --gpu-memory-utilization 0.9 \
 --additional-config \
'{"torchair_graph_config":{"enabled":true,"enable_multistream_moe":true,"enable_super_kernel":true,"use_cached_graph":true,"enable_multistream_mla":true,"graph_batch_sizes":[16]},"chunked_prefill_for_mla":true,"enable_weight_nz_layout":true}'""",
        expect={"model": "/mnt/share/weight/DeepSeek-R1-0528_w8a8_MTP_float", "port": 20002, "data_parallel_size": 1, "tensor_parallel_size": 16, "served_model_name": ("dsv3",), "max_model_len": 5200},
    ),
)
