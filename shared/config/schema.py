"""``AdditionalConfig``: every top-level key of vLLM-Ascend's ``--additional-config``.

Defaults are vLLM-Ascend's. ``ascend_only=True`` marks keys whose effect is an Ascend
kernel, communication op, graph mode or runtime setting of vLLM-Ascend's; they are
accepted, validated and reported as without effect - on cpu and cuda, and on npu too,
where pdmesh's backend does not implement them. Nested sections live in ``scheduler_schema`` and
``feature_schema``; deprecated and removed spellings in ``legacy``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pdmesh.shared.config.feature_schema import (
    AscendCompilationConfig,
    AscendFusionConfig,
    DynamicSpecConfig,
    EplbConfig,
    FinegrainedTPConfig,
    QuestDecodeConfig,
    RejectionSamplerConfig,
    RlConfig,
    SparseKVOffloadConfig,
    WeightPrefetchConfig,
    XliteGraphConfig,
)
from pdmesh.shared.config.options import option, section
from pdmesh.shared.config.scheduler_schema import SchedulerConfig

NPU = {"ascend_only": True}


@dataclass(frozen=True)
class AdditionalConfig:
    """The parsed, validated ``--additional-config``; every value resolved.

    Produced by ``pdmesh.shared.config.parse_additional_config``. ``warnings`` and
    ``inactive_keys`` are what parsing had to say; they are not configuration keys.
    """

    # ---- sections -------------------------------------------------------------------
    scheduler_config: SchedulerConfig = section(SchedulerConfig, "Scheduler policies.")
    eplb_config: EplbConfig = section(EplbConfig, "vLLM-Ascend EPLB extensions.")
    rejection_sampler_config: RejectionSamplerConfig = section(
        RejectionSamplerConfig, "Block / entropy verify for speculative decoding.")
    dynamic_spec_config: DynamicSpecConfig = section(
        DynamicSpecConfig, "Dynamic speculative decoding budget.")
    finegrained_tp_config: FinegrainedTPConfig = section(
        FinegrainedTPConfig, "Per-module tensor-parallel sizes.")
    rl_config: RlConfig = section(RlConfig, "One-click RL mode.", **NPU)
    ascend_compilation_config: AscendCompilationConfig = section(
        AscendCompilationConfig, "Ascend graph compilation passes.", **NPU)
    ascend_fusion_config: AscendFusionConfig = section(
        AscendFusionConfig, "Fused Ascend operators.", **NPU)
    xlite_graph_config: XliteGraphConfig = section(XliteGraphConfig, "Xlite graph mode.", **NPU)
    weight_prefetch_config: WeightPrefetchConfig = section(
        WeightPrefetchConfig, "Weight prefetch.", **NPU)
    sparse_kv_offload_config: SparseKVOffloadConfig = section(
        SparseKVOffloadConfig, "Sparse KV offload to host memory.", **NPU)
    quest_decode_config: QuestDecodeConfig = section(
        QuestDecodeConfig, "QUEST sparse decode attention.", **NPU)

    # ---- MoE, communication and multistream -----------------------------------------
    multistream_overlap_shared_expert: bool = option(
        False, "Run shared experts on a second stream (MoE with shared experts).", **NPU)
    multistream_overlap_gate: bool = option(False, "Overlap the MoE gate on a stream.", **NPU)
    multistream_dsv4_dsa_overlap: bool = option(True, "DeepSeek-V4 DSA multistream overlap.",
                                                **NPU)
    multistream_dsa_preprocess: bool = option(
        False, "DeepSeek-V4 DSA preprocess on a second stream (decode).", **NPU)
    enable_fused_mc2: int = option(
        0, "Fused MC2: 0 off, 1 dispatch_ffn_combine, 2 MegaMoe.", choices=(0, 1, 2), **NPU)
    enable_prefill_mc2: bool = option(False, "Reserve MC2 token capacity for prefill.", **NPU)
    mc2_comm_alg: str = option("", "MC2 dispatch/combine comm_alg.",
                               choices=("", "fullmesh", "hierarchy", "fullmesh_v2"), **NPU)
    enable_mc2_hierarchy_comm: bool = option(
        False, "Deprecated: same as mc2_comm_alg=\"hierarchy\".", **NPU)
    combine_quant_mode: int = option(
        0, "Force the MC2 combine comm quant mode; 0 uses the model's.", choices=(0, 2, 3, 4),
        **NPU)
    mega_moe_max_tokens: int = option(
        65536, "Per-rank token capacity after dispatch in MegaMoe.", gt=0, **NPU)
    enable_shared_expert_dp: bool = option(
        False, "Replicate shared experts and run them data-parallel (needs EP and TP > 1).")
    enable_force_eplb: bool = option(False, "Force static EPLB placement.")
    mix_placement: bool = option(False, "Mix shared and routed expert placement.")
    enable_flashcomm1: bool = option(False, "FlashComm1 sequence-parallel MoE.", **NPU)
    flashcomm2_parallel_size: int = option(0, "FlashComm2 parallel size; 0 off.", ge=0, **NPU)
    enable_matmul_allreduce: bool = option(False, "Fused matmul + allreduce.", **NPU)

    # ---- attention, KV cache and weights ---------------------------------------------
    enable_kv_nz: bool = option(False, "KV cache in NZ layout (MLA, decode nodes).", **NPU)
    weight_nz_mode: int = option(
        1, "Weights in NZ layout: 0 off, 1 quantized weights, 2 all.", choices=(0, 1, 2), **NPU)
    enable_mlapo: bool = option(True, "MLAPO for DeepSeek W8A8.", **NPU)
    mlapo_keep_prefill_weights: bool = option(
        False, "Keep MLAPO prefill weights on decode nodes (needs enable_mlapo).", **NPU)
    enable_transpose_kv_cache_by_block: bool = option(
        True, "Transpose KV cache by block.", **NPU)
    enable_dsa_cp: bool = option(
        False, "DSA context parallel for DeepSeek V3.2 / V4 (turns FlashComm1 on).", **NPU)
    enable_context_parallel: bool = option(False, "Context parallelism.")
    enable_sparse_sfa_c8: bool = option(False, "Packed C8 KV cache for Sparse Flash Attention.",
                                        **NPU)
    enable_sparse_li_c8: bool = option(False, "C8 key/scale caches for LightningIndexer.", **NPU)
    c8_enable_reshape_optim: bool = option(
        False, "StoreKVBlock for LightningIndexer C8 writes (needs enable_sparse_li_c8).", **NPU)
    enable_kvpp: bool = option(False, "Split persistent MLA KV layers across TP ranks.", **NPU)
    enable_pcp_o_proj_weight_sharding: bool = option(False, "Shard o_proj weights over PCP.",
                                                     **NPU)
    pa_shape_list: tuple[int, ...] = option((), "Custom shapes for paged attention ops.", **NPU)
    layer_sharding: tuple[str, ...] | None = option(
        None, "Linear layers to shard across ranks, e.g. [\"q_b_proj\"] (prefill).", **NPU)

    # ---- sampling and scheduling extras ----------------------------------------------
    enable_reduce_sample: bool = option(
        False, "Sample from TP-partitioned logits (experimental; no logprobs).")
    enable_async_exponential: bool = option(False, "Asynchronous exponential overlap.", **NPU)
    draft_window_size: int | None = option(None, "Draft window size for speculative decoding.")
    SLO_limits_for_dynamic_batch: int = option(-1, "SLO limit of dynamic batching; -1 off.",
                                               ge=-1)

    # ---- runtime, debugging and observability ----------------------------------------
    refresh: bool = option(False, "Rebuild vLLM-Ascend's cached config (RL, tests).", **NPU)
    enable_cpu_binding: bool = option(True, "Bind workers to NUMA-local CPUs (ARM hosts).",
                                      **NPU)
    ft_communication_abort_timeout: int = option(
        0, "Comm op abort timeout in seconds: 0 off, else >= 2.", ge=0, **NPU)
    msmonitor_use_daemon: bool = option(False, "Run msmonitor as a daemon.", **NPU)
    ascend_log_path: str = option("~/ascend/log/vllm_ascend", "Ascend log folder.", **NPU)
    dump_config_path: str | None = option(None, "msprobe dump config file.", **NPU)
    dump_config: dict[str, Any] | None = option(None, "Inline msprobe dump config.", **NPU)

    # ---- what parsing found (not configuration keys) ---------------------------------
    warnings: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    inactive_keys: tuple[str, ...] = dataclasses.field(default=(), compare=False)
