"""Feature switches that depend on each other or on the node role.

Seed references are to ``shared/seeds/additional-config.zh.txt``; "code" is
``vllm_ascend/ascend_config.py``.
"""

from __future__ import annotations

from pdmesh.shared.config.rules.base import Findings, RuleContext
from pdmesh.shared.engine.spec_decode import MTP_METHODS


def dynamic_spec(ctx: RuleContext, out: Findings) -> None:
    """dynamic_spec_config needs a speculative config with the same method; it only tunes
    how many drafted tokens are verified (seed line 70: "仍然需要匹配的 speculative_config
    （method: "dspark" 或 "dflash"）"; "针对 model runner v1 的探索性功能")."""
    spec = ctx.config.dynamic_spec_config
    if spec.method is None:
        if ctx.set_under("dynamic_spec_config.method_params"):
            out.warn(ctx.name("dynamic_spec_config.method_params"),
                     "ignored because dynamic_spec_config.method is not set")
        return
    key = ctx.name("dynamic_spec_config.method")
    have = ctx.engine.speculative_method
    if have in MTP_METHODS:
        # pdmesh's extension: MTP drafts carry logits, so dflash's headless confidence
        # (their max softmax) budgets them; dspark reads a head MTP layers do not have
        if spec.method == "dspark":
            out.error(key, f"dspark needs a draft model with a confidence head; the \"{have}\" "
                           "drafts have none (\"dflash\" estimates confidence without one)")
        else:
            out.warn(key, f"budgets the \"{have}\" drafts with dflash's confidence (their max "
                          "softmax); vLLM-Ascend runs it with a DFlash draft model")
    elif have != spec.method:
        have_shown = f'"{have}"' if have else "unset"
        out.error(key, f"needs --speculative-config with method \"{spec.method}\", but the "
                       f"speculative method is {have_shown}")
    if ctx.engine.model_runner_v2:
        out.warn(key, "exploratory feature of Model Runner V1; untested with Model Runner V2")


def rl_mode(ctx: RuleContext, out: Findings) -> None:
    """RL mode forces weight_nz_mode=0 over the top-level value; when disabled its other
    fields are ignored (seed line 84: "强制设置 AscendConfig.weight_nz_mode=0"; line 86:
    "其固定的 NZ 设置优先于顶层 weight_nz_mode 配置"; line 84: "当 enabled 为 false 时，所有
    其他子字段均被忽略")."""
    rl = ctx.config.rl_config
    if not rl.enabled:  # (its other keys: switches.keys_of_a_switched_off_section)
        return
    if ctx.config.weight_nz_mode != 0:
        warning = None
        if ctx.is_set("weight_nz_mode"):
            warning = "overridden to 0 because rl_config.enabled is true"
        out.override("weight_nz_mode", 0, warning, key=ctx.name("weight_nz_mode"))


def sparse_c8(ctx: RuleContext, out: Findings) -> None:
    """c8_enable_reshape_optim needs enable_sparse_li_c8 and only acts on prefill nodes
    (additional_config.md); seed line 37 warns of a conflict on HDK <= 0.26.0."""
    if not ctx.config.c8_enable_reshape_optim:
        return
    key = ctx.name("c8_enable_reshape_optim")
    if not ctx.config.enable_sparse_li_c8:
        out.error(key, "needs enable_sparse_li_c8: true")
    if ctx.engine.is_decode_node:
        out.warn(key, "only acts on prefill nodes; ignored on this decode node")
    out.warn(key, "on HDK 0.26.0 or older it may conflict with pooling models that use AICPU "
                  "operators (vLLM-Ascend issue #15896); set it to false if they fail")


def graph_compilation(ctx: RuleContext, out: Findings) -> None:
    """Static kernels need npugraph_ex (code: AscendCompilationConfig); Xlite excludes
    pipeline parallelism and full_mode needs enabled (code: XliteGraphConfig)."""
    comp = ctx.config.ascend_compilation_config
    if comp.enable_static_kernel and not comp.enable_npugraph_ex:
        out.error(ctx.name("ascend_compilation_config.enable_static_kernel"),
                  "needs ascend_compilation_config.enable_npugraph_ex: true")
    xlite = ctx.config.xlite_graph_config
    if xlite.enabled and ctx.engine.pipeline_parallel_size > 1:
        out.error(ctx.name("xlite_graph_config.enabled"),
                  "Xlite graph mode does not support pipeline parallelism")
    if xlite.full_mode and not xlite.enabled:
        out.warn(ctx.name("xlite_graph_config.full_mode"),
                 "ignored because xlite_graph_config.enabled is false")


def decode_node_features(ctx: RuleContext, out: Findings) -> None:
    """Features that only exist on decode nodes (code): the NZ KV cache, and sparse KV
    offload unless it keeps the device cache for debugging."""
    cfg = ctx.config
    if cfg.enable_kv_nz and not ctx.engine.is_decode_node:
        out.error(ctx.name("enable_kv_nz"), "the NZ KV cache only runs on PD-disaggregated "
                                            "decode nodes (kv_role \"kv_consumer\")")
    offload = cfg.sparse_kv_offload_config
    if offload.enabled:
        key = ctx.name("sparse_kv_offload_config.enabled")
        if not offload.keep_device_kv_cache and not ctx.engine.is_decode_node:
            out.error(key, "sparse KV offload only runs on decode nodes (kv_role "
                           "\"kv_consumer\"); set keep_device_kv_cache for debugging elsewhere")
        engine = ctx.engine
        if engine.pipeline_parallel_size > 1:
            out.error(key, "sparse KV offload does not support pipeline parallelism")
        if engine.prefill_context_parallel_size * engine.decode_context_parallel_size > 1:
            out.error(key, "sparse KV offload does not support context parallelism")
        if engine.model_runner_v2:
            out.error(key, "sparse KV offload does not support Model Runner V2")
        if cfg.enable_sparse_sfa_c8:
            out.error(key, "sparse KV offload cannot be combined with enable_sparse_sfa_c8")
        out.warn(key, "without effect: pdmesh keeps DeepSeek-V4's compressed history in the "
                      "engine's device blocks for as long as its request runs; what moves to "
                      "host memory is whole blocks between requests "
                      "(--enable-hierarchical-cache, docs/kv-tiers.md), not the per-step "
                      "top-k fetch this key asks of vLLM-Ascend's sparse attention kernels")


def single_switches(ctx: RuleContext, out: Findings) -> None:
    """Small dependencies (code, additional_config.md): MLAPO weights need MLAPO, one dump
    config source, QUEST needs topk_pages, the abort timeout is 0 or >= 2 seconds."""
    cfg = ctx.config
    if cfg.mlapo_keep_prefill_weights and not cfg.enable_mlapo:
        out.error(ctx.name("mlapo_keep_prefill_weights"), "needs enable_mlapo: true")
    if cfg.dump_config is not None and cfg.dump_config_path is not None:
        out.error(ctx.name("dump_config"), "give dump_config or dump_config_path, not both")
    if cfg.quest_decode_config.enable and cfg.quest_decode_config.topk_pages is None:
        out.error(ctx.name("quest_decode_config.topk_pages"),
                  "required when quest_decode_config.enable is true")
    if cfg.ft_communication_abort_timeout == 1:
        out.error(ctx.name("ft_communication_abort_timeout"),
                  "must be 0 (off) or at least 2 seconds, got 1")


RULES = (dynamic_spec, rl_mode, sparse_c8, graph_compilation, decode_node_features,
         single_switches)
