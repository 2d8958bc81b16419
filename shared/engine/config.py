"""Engine configuration: one frozen dataclass, flag names as ``vllm serve`` spells them.

Its field defaults are the engine's only ones: the flag table (``config.flags``
``ENGINE_DEFAULT``) and the offline ``LLM`` take them from here. Every `pdmesh` command
reads the flag table, so this module imports no torch (its heavy imports stay inside
functions; tests/shared/config/test_defaults.py checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB, when nothing else is said on a CPU
# pdmesh.shared.engine.policy (lpm, lof, random: SGLang's --schedule-policy)
SCHEDULING_POLICIES = ("fcfs", "priority", "short_request_first", "lpm", "lof", "random")
QUANTIZATIONS = (None, "ascend", "modelslim", "fp8")  # pdmesh.shared.models.quantization
KV_CACHE_DTYPES = ("auto", "int8")


# field -> the least value it takes (a field that may be None is unchecked when it is)
AT_LEAST = {
    "max_model_len": 1,
    "max_num_seqs": 1,
    "max_num_batched_tokens": 1,
    "priority_preemption_threshold": 0,
    "short_request_threshold": 0,
    "short_request_long_max_wait_ms": 0,
    "max_queued_requests": 1,
    "num_kv_blocks": 1,
    "kv_cache_memory_bytes": 1,
    "tensor_parallel_size": 1,
    "data_parallel_size": 1,
    "num_redundant_experts": 0,
    "expert_load_window": 0,
}

@dataclass(frozen=True)
class EngineConfig:
    model: str
    # --tokenizer (SGLang's --tokenizer-path): the folder whose tokenizer.json grammars
    # are compiled against (None: the model's)
    tokenizer: str | None = None
    device: str = "auto"  # auto | npu | cuda | cpu
    dtype: str = "auto"  # auto (the checkpoint's) | float32 | bfloat16 | float16
    # --quantization: "ascend" (modelslim checkpoints), "fp8" (DeepSeek's block FP8, also
    # detected without it), None (plain floats, or a format the checkpoint's config names)
    quantization: str | None = None
    # --kv-cache-dtype: "auto" (the model's dtype) or "int8" (each token's K and V per
    # head in int8 with a float32 scale kept beside it in the same blocks)
    kv_cache_dtype: str = "auto"
    seed: int = 0
    block_size: int = 128
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: max(8192, max_model_len)... see resolve
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # fcfs | priority | short_request_first
    # priority: lower values first (vLLM's --scheduling-policy priority); False: larger
    # values first (SGLang's --enable-priority-scheduling without
    # --schedule-low-priority-values-first)
    priority_low_values_first: bool = True
    # priority: a waiting request preempts running ones whose priority is worse by more
    # than this (SGLang's --priority-scheduling-preemption-threshold); None: it never does
    priority_preemption_threshold: int | None = None
    # the priority of a request that gives none (SGLang's --default-priority-value)
    default_priority: int = 0
    # a request that gives a priority to an engine not scheduling by priority is refused
    # (SGLang's --abort-on-priority-when-disabled); otherwise its priority is ignored,
    # with a warning
    abort_on_priority_when_disabled: bool = False
    # short_request_first (vLLM-Ascend's scheduler_config.short_request_first_config):
    # prompts of at most this many tokens are short; a long request waiting this long is
    # served before short ones (0: never)
    short_request_threshold: int = 256
    short_request_long_max_wait_ms: float = 0.0
    # Serving only (EngineLoop): a request arriving while this many wait (not yet
    # running) is refused; None: no limit
    max_queued_requests: int | None = None
    # KV cache size: explicit block count, or bytes, or a fraction of device memory.
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # Data-parallel ranks of one instance: each rank is an engine with its own requests
    # and KV cache; with expert parallelism the MoE layers' experts are spread over the
    # ranks, which then step in lockstep (``data_parallel_address``: rank 0's host:port
    # for the process group).
    data_parallel_size: int = 1
    # Tensor parallelism: this engine is rank 0 of N processes sharing every layer; it
    # starts the other N - 1 (pdmesh.shared.parallel.tensor_parallel)
    tensor_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_address: str | None = None
    enable_expert_parallel: bool = False
    # vLLM-Ascend's finegrained_tp_config (``*_tensor_parallel_size`` keys): embedding,
    # lm_head, o_proj and dense MLPs split over groups of DP ranks, which then step in
    # lockstep (pdmesh.shared.parallel.finegrained_tp)
    finegrained_tp_config: dict[str, int] | None = None
    # with TP and EP: the shared experts whole on every TP rank, each running them on its
    # share of the tokens (vLLM-Ascend's enable_shared_expert_dp)
    enable_shared_expert_dp: bool = False
    num_redundant_experts: int = 0
    expert_map_path: str | None = None
    expert_map_record_path: str | None = None  # rank 0 writes each applied placement here
    # the EPLB controller's policy for this instance: vLLM-Ascend's eplb_policy_type (0
    # its test swap, 1 DeepSeek's, 2 SwiftBalance, 3 FlashLB); None: DeepSeek's (vLLM's)
    eplb_policy_type: int | None = None
    # step-driven EPLB rounds (shared.parallel.eplb_rank.Cadence): "vllm-ascend" (its
    # expert_heat_collection_interval, then algorithm_execution_interval, then a step per
    # MoE layer), "vllm" (--eplb-config's step_interval); None: the controller's timer
    eplb_rounds: str | None = None
    eplb_step_interval: int = 3000  # vLLM's eplb_config.step_interval
    eplb_algorithm_steps: int = 50  # vLLM-Ascend's eplb_config.algorithm_execution_interval
    # Expert load kept over this many steps (0: not recorded), for EPLB
    expert_load_window: int = 0
    expert_load_phase: str = "all"
    # DyntraLB (scheduler_config.dyntra_lb_config, parsed): balances lockstep DP ranks
    dyntra_lb: Any = None
    # vLLM-Ascend's recompute scheduler (decode instances): a request that cannot get a
    # KV block finishes as "recomputed" and the gateway continues it elsewhere
    recompute_scheduler: bool = False
    # Pool instances: a prompt's pool read still running after this many seconds is
    # given up and the prompt computed here (None or 0: wait for it)
    kv_load_timeout_s: float | None = 10.0
    # vLLM's kv_load_failure_policy: a request whose pool or tier read fails is
    # "recompute"d here, or ends with an error ("fail")
    kv_load_failure_policy: str = "recompute"
    # vLLM-Ascend's load_async (kv_connector_extra_config): pool and tier reads run
    # beside the steps (True) or inside the step that admits the request (False)
    kv_load_async: bool = True
    # vLLM-Ascend's consumer_is_to_put (a decode instance): each request it finishes puts
    # its KV (prompt and answer) into the pool, for the conversation's next turn
    kv_put_finished: bool = False
    # speculative decoding: vLLM's speculative_config (a dict, as `LLM(...,
    # speculative_config={...})` takes it, or a spec_decode.SpeculativeConfig); None: off
    speculative_config: Any = None
    # Decode graphs (cuda: CUDA graphs, npu: ACL graphs; pdmesh.shared.engine.graph_config):
    # vLLM's enforce_eager and compilation_config ({"cudagraph_mode": ...,
    # "cudagraph_capture_sizes": [...], ...}); cuda_graph_padding False: a decode batch
    # between two capture sizes runs eagerly (SGLang's --disable-cuda-graph-padding)
    enforce_eager: bool = False
    compilation_config: dict[str, Any] | None = None
    cuda_graph_padding: bool = True
    # vLLM's --runner: "generate", or "pooling" (--convert embed, SGLang's
    # --is-embedding): every request ends in its prompt's embedding
    # (pdmesh.shared.engine.pooling), none generates; "auto": generate
    runner: str = "auto"
    # vLLM's --pooler-config: the pooling's defaults over the checkpoint's
    # ({"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool, "dimensions": n})
    pooler_config: dict[str, Any] | None = None
    # the periodic stats line (pdmesh.shared.engine.stats_log): vLLM's every so many
    # seconds (0: none; serving: VLLM_LOG_STATS_INTERVAL, 10, unless --disable-log-stats),
    # SGLang's every so many decoding steps (--decode-log-interval; 0: none)
    log_stats_interval_s: float = 0.0
    decode_log_interval: int = 0
    # vLLM's --hf-overrides (SGLang's --json-model-override-args): config.json keys laid
    # over the checkpoint's (shared.models.config.OVERRIDABLE: rope and positions)
    hf_overrides: dict[str, Any] | None = None
    # vLLM's --cpu-offload-gb: GiB of decoder-layer weights kept in host memory, copied
    # to the device layer by layer each forward (engine/weight_offload.py); 0: none
    cpu_offload_gb: float = 0.0
    # LoRA adapters (engine/lora.py): vLLM's --enable-lora, --max-loras (device slots, the
    # adapters one step runs at most), --max-lora-rank, --max-cpu-loras (held in host
    # memory; None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # adapters read at start and served by name: vLLM's --lora-modules (name, folder)
    lora_modules: tuple[tuple[str, str], ...] = ()
    # KV tiers under the prefix cache (engine/kv_tiers.py: SGLang's HiCache, vLLM's
    # --kv-offloading-size): a kv_tiers.TierConfig, or None (L1 alone)
    kv_tiers: Any = None

    @property
    def pools(self) -> bool:
        """The pooling runner: embeddings, no generation."""
        return self.runner == "pooling"

    def graph_config(self) -> Any:
        """The decode graphs' GraphConfig (ValueError naming a bad compilation_config
        key)."""
        from pdmesh.shared.engine.graph_config import GraphConfig

        if self.compilation_config is not None and not isinstance(self.compilation_config,
                                                                  dict):
            raise ValueError(f"compilation_config: must be a JSON object, got "
                             f"{self.compilation_config!r}")
        return GraphConfig.from_flags(self.max_num_seqs,
                                      self.enforce_eager or bool(self.cpu_offload_gb)
                                      or self.enable_lora,  # (adapters run eagerly)
                                      self.compilation_config,
                                      disable_padding=not self.cuda_graph_padding)

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size: must be in [1, 1024], got {self.block_size}")
        for name, least in AT_LEAST.items():
            value = getattr(self, name)
            if value is not None and value < least:
                raise ValueError(f"{name}: must be >= {least}, got {value}")
        if self.kv_load_timeout_s is not None and not self.kv_load_timeout_s >= 0:
            raise ValueError(f"kv_load_timeout_s: must be >= 0 (0: no timeout), got "
                             f"{self.kv_load_timeout_s}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        self._validate_choices()
        self._validate_parallel()
        self._validate_lora()
        self._validate_tiers()
        self.graph_config()

    def _validate_tiers(self) -> None:
        if not self.kv_load_async and self.tensor_parallel_size > 1:
            raise ValueError("load_async: false is not for tensor_parallel_size > 1 (the "
                             "ranks take their heads of a read between two steps)")
        if self.kv_tiers is None:
            return
        self.kv_tiers.validate()
        for name, why in (("tensor_parallel_size", "each rank holds its heads of a block; "
                           "the tiers keep whole blocks"),):
            value = getattr(self, name)
            if value and value != 1:
                raise ValueError(f"--enable-hierarchical-cache: not with {name} ({why})")
        if not self.enable_prefix_caching:
            raise ValueError("--enable-hierarchical-cache: needs the prefix cache (not with "
                             "--no-enable-prefix-caching / --disable-radix-cache)")

    def _validate_lora(self) -> None:
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("lora_modules: needs enable_lora (--enable-lora)")
            return
        for name, least in (("max_loras", 1), ("max_lora_rank", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"{name}: must be >= {least}, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras: must be >= max_loras ({self.max_loras}), got "
                             f"{self.max_cpu_loras}")
        for name, why in (("tensor_parallel_size", "adapters are not sharded over tensor-"
                           "parallel ranks yet"),
                          ("speculative_config", "the drafts would run without the adapter"),
                          ("finegrained_tp_config", "adapters are not split over DP ranks"),
                          ("cpu_offload_gb", "adapters are not streamed with offloaded "
                           "layers")):
            value = getattr(self, name)
            if value and value != 1:
                raise ValueError(f"enable_lora: not with {name} ({why})")

    def _validate_choices(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: pdmesh loads ascend (modelslim; SGLang's "
                             f"modelslim) and fp8 (DeepSeek's block FP8) checkpoints, not "
                             f"{self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: pdmesh keeps the KV cache in the model's "
                             f"dtype (auto) or in int8, not {self.kv_cache_dtype!r}")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner: must be auto, generate or pooling, got {self.runner!r}")
        from pdmesh.shared.models.config import check_overrides

        check_overrides(self.hf_overrides)
        if self.pooler_config is not None and not isinstance(self.pooler_config, dict):
            raise ValueError(f"pooler_config: must be a JSON object, got "
                             f"{self.pooler_config!r}")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"kv_load_failure_policy: must be recompute or fail, got "
                             f"{self.kv_load_failure_policy!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: must be one of "
                             f"{', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")

    def _validate_parallel(self) -> None:
        from pdmesh.shared.engine.weight_offload import check_offload
        from pdmesh.shared.parallel.finegrained_tp import FineGrainedLayout

        check_offload(self)
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank: must be in [0, {self.data_parallel_size}), "
                             f"got {self.data_parallel_rank}")
        fine = FineGrainedLayout.from_config(self.finegrained_tp_config,
                                             self.data_parallel_rank, self.data_parallel_size)
        if fine is not None and self.tensor_parallel_size > 1:
            raise ValueError("finegrained_tp_config: splits modules over DP ranks, so it needs "
                             f"tensor_parallel_size 1, got {self.tensor_parallel_size}")
        if fine is not None and self.speculative_config is not None:
            raise ValueError("finegrained_tp_config: not yet with speculative decoding (the "
                             "drafts' forwards would break the ranks' lockstep)")
        if self.enable_expert_parallel and self.data_parallel_size > 1 \
                and not self.data_parallel_address:
            raise ValueError("data_parallel_address: expert parallelism over "
                             f"{self.data_parallel_size} ranks needs rank 0's host:port")
