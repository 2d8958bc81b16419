"""The nested sections of ``--additional-config`` other than ``scheduler_config``.

Defaults and ranges are vLLM-Ascend's (``vllm_ascend/ascend_config.py`` and
``docs/source/user_guide/configuration/additional_config.md``). ``ascend_only`` marks
sections whose effect is an Ascend kernel, graph mode or runtime setting.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdmesh.shared.config.options import option, section

PHASES = ("all", "prefill", "decode")


@dataclass(frozen=True)
class EplbConfig:
    """``eplb_config``. Model Runner V1 takes every field but ``load_collection_phase``;
    Model Runner V2 takes only ``load_collection_phase`` and configures the rest through
    upstream ``--enable-eplb`` / ``--eplb-config`` (checked in ``rules.eplb``)."""

    dynamic_eplb: bool = option(False, "MRv1: enable legacy dynamic EPLB.")
    expert_map_path: str | None = option(
        None, "MRv1: load a recorded static expert map.", suffix=".json")
    expert_heat_collection_interval: int = option(
        600, "MRv1: forward iterations used to collect expert heat.", ge=0)
    algorithm_execution_interval: int = option(
        50, "MRv1: iterations the EPLB worker has to finish its CPU task.", ge=0)
    expert_map_record_path: str | None = option(
        None, "MRv1: save the computed expert map here (turns dynamic_eplb on).", suffix=".json")
    num_redundant_experts: int = option(0, "MRv1: redundant experts placed at start.", ge=0)
    eplb_policy_type: int = option(
        2, "MRv1 policy: 0 random, 1 default, 2 SwiftBalance, 3 FlashLB.", choices=(0, 1, 2, 3))
    eplb_heat_collection_stage: str = option(
        "all", "MRv1: which phase's expert heat is collected.", choices=PHASES)
    load_collection_phase: str = option(
        "all", "MRv2: which phase submits expert load; a batch with any prefill counts as "
        "prefill.", choices=PHASES)


@dataclass(frozen=True)
class RejectionSamplerConfig:
    """``rejection_sampler_config``: block and entropy verification for speculative decoding
    (faster, at some cost in sampling precision)."""

    enable_block_verify: bool = option(False, "Verify all draft tokens as one block.")
    enable_entropy_verify: bool = option(False, "Lower the acceptance threshold by entropy.")
    posterior_threshold: float = option(
        0.95, "Upper bound of the entropy-adjusted threshold, in (0, 1].", gt=0, le=1)
    posterior_alpha: float = option(0.4, "Entropy scaling in the threshold.", ge=0)


@dataclass(frozen=True)
class DynamicSpecParams:
    """``dynamic_spec_config.method_params`` for "dspark" and "dflash" (shared knobs)."""

    initial_verify_budget_per_req: int = option(
        5, "Verify budget per request before the first recompute.", ge=0)
    budget_update_interval: int = option(16, "Recompute the budget every N decode steps.", gt=0)
    budget_threshold: float = option(
        0.3, "Cumulative survival-probability threshold for the budget.", gt=0, le=1)
    min_verify_tokens: int = option(1, "Fewest draft tokens verified per request.", ge=0)


@dataclass(frozen=True)
class DynamicSpecConfig:
    """``dynamic_spec_config``: how many drafted tokens each request verifies (exploratory,
    Model Runner V1; needs a speculative config with the same method)."""

    method: str | None = option(None, "Dynamic method; null disables.",
                                choices=("dspark", "dflash"))
    method_params: DynamicSpecParams = section(DynamicSpecParams, "Method hyperparameters.")


@dataclass(frozen=True)
class RlConfig:
    """``rl_config``: one-click RL mode. When enabled it forces weight_nz_mode=0; when
    disabled every other field is ignored."""

    enabled: bool = option(False, "Master switch for RL mode.")
    sleep_mode_extra_cleanup: bool = option(
        False, "Same-device mode: release HCCL groups and graph workspaces on sleep.")
    enable_training_consistency: bool = option(
        False, "Use the FA3 attention backend for training-inference consistency.")
    enable_batch_invariant: bool = option(False, "Set VLLM_BATCH_INVARIANT=1 for the workers.")


@dataclass(frozen=True)
class FinegrainedTPConfig:
    """``finegrained_tp_config``: per-module tensor-parallel sizes (0 = the model's TP)."""

    lmhead_tensor_parallel_size: int = option(0, "TP size of lm_head.", ge=0)
    oproj_tensor_parallel_size: int = option(0, "TP size of o_proj (decode nodes only).", ge=0)
    embedding_tensor_parallel_size: int = option(0, "TP size of the embedding.", ge=0)
    mlp_tensor_parallel_size: int = option(0, "TP size of the MLP.", ge=0)


@dataclass(frozen=True)
class AscendCompilationConfig:
    """``ascend_compilation_config``: compile-time FX passes for Ascend graph mode."""

    enable_npugraph_ex: bool = option(True, "npugraph_ex FX optimisation before ACLGraph.")
    enable_static_kernel: bool = option(
        False, "Precompile fixed-shape kernels (needs enable_npugraph_ex).")
    fuse_norm_quant: bool = option(True, "fuse_norm_quant pass.")
    fuse_qknorm_rope: bool = option(True, "fuse_qknorm_rope pass (needs Triton).")
    fuse_muls_add: bool = option(True, "fuse_muls_add pass.")
    fuse_allreduce_rms: bool = option(False, "fuse_allreduce_rms pass (conflicts with SP).")


@dataclass(frozen=True)
class AscendFusionConfig:
    """``ascend_fusion_config``: fused Ascend operators."""

    fusion_ops_gmmswigluquant: bool = option(True, "Use the fused gmm+swiglu+quant operator.")


@dataclass(frozen=True)
class XliteGraphConfig:
    """``xlite_graph_config``: Xlite graph mode (Llama, Qwen dense, Qwen3-VL)."""

    enabled: bool = option(False, "Enable Xlite graph mode (decode only by default).")
    full_mode: bool = option(False, "Run prefill under Xlite too.")


@dataclass(frozen=True)
class AttnPrefetchRatio:
    """``weight_prefetch_config.prefetch_ratio.attn``."""

    qkv: float = option(1.0, "Share of the qkv weight prefetched.", ge=0)
    o: float = option(1.0, "Share of the o weight prefetched.", ge=0)


@dataclass(frozen=True)
class MoePrefetchRatio:
    """``weight_prefetch_config.prefetch_ratio.moe``."""

    gate_up: float = option(0.8, "Share of the gate_up weight prefetched.", ge=0)


@dataclass(frozen=True)
class MlpPrefetchRatio:
    """``weight_prefetch_config.prefetch_ratio.mlp``."""

    gate_up: float = option(1.0, "Share of the gate_up weight prefetched.", ge=0)
    down: float = option(1.0, "Share of the down weight prefetched.", ge=0)


@dataclass(frozen=True)
class PrefetchRatio:
    """``weight_prefetch_config.prefetch_ratio``."""

    attn: AttnPrefetchRatio = section(AttnPrefetchRatio, "Attention weights.")
    moe: MoePrefetchRatio = section(MoePrefetchRatio, "MoE weights.")
    mlp: MlpPrefetchRatio = section(MlpPrefetchRatio, "Dense MLP weights.")


@dataclass(frozen=True)
class WeightPrefetchConfig:
    """``weight_prefetch_config``: prefetch weights ahead of the matmuls that read them."""

    enabled: bool = option(False, "Enable weight prefetch.")
    prefetch_ratio: PrefetchRatio = section(PrefetchRatio, "Prefetch share per weight.")


@dataclass(frozen=True)
class SparseKVOffloadConfig:
    """``sparse_kv_offload_config``: keep sparse-attention KV in host memory (decode nodes)."""

    enabled: bool = option(False, "Enable sparse KV offload.")
    topk_buffer_size: int = option(4096, "Device buffer for the top-k blocks.", gt=0)
    dram_size_per_dp_GB: int = option(128, "Host memory per DP rank, GiB.", gt=0)
    keep_device_kv_cache: bool = option(False, "Also keep the device KV cache (debug only).")
    use_fused_overlap: bool = option(False, "Overlap the fetch with compute in one kernel.")


@dataclass(frozen=True)
class QuestDecodeConfig:
    """``quest_decode_config``: QUEST sparse decode attention."""

    enable: bool = option(False, "Enable QUEST sparse decode attention.")
    topk_pages: int | None = option(
        None, "KV pages (128 tokens) read per decode step; required when enabled.",
        ge=8, multiple_of=8)
