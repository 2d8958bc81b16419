"""Parallel layouts and MoE communication: KVPP, fine-grained TP, MC2, shared experts.

Seed references are to ``shared/seeds/additional-config.zh.txt``; "code" is
``vllm_ascend/ascend_config.py`` (AscendConfig.derive_and_validate, FinegrainedTPConfig).
"""

from __future__ import annotations

from pdmesh.shared.config.rules.base import Findings, RuleContext


def kvpp(ctx: RuleContext, out: Findings) -> None:
    """KVPP needs eager mode, no KV transfer connector, no DCP, and Model Runner V2 for PCP.

    Seed line 159: "PCP 需要 VLLM_USE_V2_MODEL_RUNNER=1。KVPP 仍要求 eager 执行和非混合
    MLA，并且不支持 DCP 或 KV 传输连接器".
    """
    if not ctx.config.enable_kvpp:
        return
    key, engine = ctx.name("enable_kvpp"), ctx.engine
    if not engine.enforce_eager:
        out.error(key, "KVPP needs eager execution (--enforce-eager)")
    if engine.kv_role is not None:
        out.error(key, f"KVPP does not support a KV transfer connector, but kv_role is "
                       f"\"{engine.kv_role}\"")
    if engine.decode_context_parallel_size > 1:
        out.error(key, f"KVPP does not support DCP, got decode_context_parallel_size="
                       f"{engine.decode_context_parallel_size}")
    if engine.prefill_context_parallel_size > 1 and not engine.model_runner_v2:
        out.error(key, "KVPP over PCP ranks needs Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1)")


def finegrained_tp(ctx: RuleContext, out: Findings) -> None:
    """Each module TP size must divide data_parallel_size; o_proj TP needs a decode node,
    tensor_parallel_size 1 and graph mode (code: FinegrainedTPConfig preconditions)."""
    tp = ctx.config.finegrained_tp_config
    engine = ctx.engine
    for name in ("lmhead_tensor_parallel_size", "oproj_tensor_parallel_size",
                 "embedding_tensor_parallel_size", "mlp_tensor_parallel_size"):
        size = getattr(tp, name)
        if size > 0 and engine.data_parallel_size % size:
            out.error(ctx.name(f"finegrained_tp_config.{name}"),
                      f"must divide data_parallel_size={engine.data_parallel_size}, got {size}")
        elif size > 1 and engine.tensor_parallel_size > 1 and name != "oproj_tensor_parallel_size":
            # (pdmesh: the module is split over DP ranks, each holding the model whole)
            out.error(ctx.name(f"finegrained_tp_config.{name}"),
                      f"splits over DP ranks: needs tensor_parallel_size 1, got "
                      f"{engine.tensor_parallel_size}")
    if tp.oproj_tensor_parallel_size > 0:
        key = ctx.name("finegrained_tp_config.oproj_tensor_parallel_size")
        if not engine.is_decode_node:
            out.error(key, "o_proj TP only runs on decode nodes (kv_role \"kv_consumer\")")
        if engine.tensor_parallel_size > 1:
            out.error(key, f"o_proj TP needs tensor_parallel_size 1, got "
                           f"{engine.tensor_parallel_size}")
        if engine.enforce_eager:
            out.error(key, "o_proj TP only runs in graph mode, not with --enforce-eager")


def mc2(ctx: RuleContext, out: Findings) -> None:
    """MC2 communication choices (code): enable_mc2_hierarchy_comm is the old spelling of
    mc2_comm_alg "hierarchy"; hierarchy excludes fused MC2; fused MC2 switches the shared
    expert stream off."""
    cfg = ctx.config
    alg = cfg.mc2_comm_alg
    if cfg.enable_mc2_hierarchy_comm:
        if ctx.is_set("mc2_comm_alg") and alg != "hierarchy":
            out.error(ctx.name("enable_mc2_hierarchy_comm"),
                      f"means mc2_comm_alg \"hierarchy\", but mc2_comm_alg is \"{alg}\"")
        else:
            alg = "hierarchy"
            out.override("mc2_comm_alg", alg, "deprecated; write mc2_comm_alg = \"hierarchy\"",
                         key=ctx.name("enable_mc2_hierarchy_comm"))
    if alg == "hierarchy" and cfg.enable_fused_mc2:
        out.error(ctx.name("enable_fused_mc2"), "fused MC2 cannot be used with mc2_comm_alg "
                                                "\"hierarchy\"; set enable_fused_mc2 to 0")
    if cfg.enable_fused_mc2 and cfg.multistream_overlap_shared_expert:
        out.override("multistream_overlap_shared_expert", False,
                     f"switched off because enable_fused_mc2={cfg.enable_fused_mc2}",
                     key=ctx.name("multistream_overlap_shared_expert"))


def shared_experts(ctx: RuleContext, out: Findings) -> None:
    """Shared-expert DP needs EP and TP > 1 (code: derived as value and ep and tp > 1);
    mix_placement excludes shared-expert DP and the shared-expert stream (code)."""
    cfg, engine = ctx.config, ctx.engine
    if cfg.enable_shared_expert_dp and not (
            engine.enable_expert_parallel and engine.tensor_parallel_size > 1):
        out.override("enable_shared_expert_dp", False, "switched off: it needs "
                     "--enable-expert-parallel and tensor_parallel_size > 1",
                     key=ctx.name("enable_shared_expert_dp"))
    if cfg.mix_placement and (cfg.enable_shared_expert_dp or cfg.multistream_overlap_shared_expert):
        out.error(ctx.name("mix_placement"), "cannot be combined with enable_shared_expert_dp "
                                             "or multistream_overlap_shared_expert")


def dsa_cp_turns_on_flashcomm(ctx: RuleContext, out: Findings) -> None:
    """DSA-CP depends on FlashComm1 and turns it on (code: "DSA-CP is enabled.
    Auto-enabling FlashComm")."""
    if ctx.config.enable_dsa_cp and not ctx.config.enable_flashcomm1:
        out.override("enable_flashcomm1", True, "turned on because enable_dsa_cp needs it")


def reduce_sample(ctx: RuleContext, out: Findings) -> None:
    """Reduce-sample excludes lm_head TP and prefill nodes (additional_config.md
    limitations; code)."""
    if not ctx.config.enable_reduce_sample:
        return
    key = ctx.name("enable_reduce_sample")
    if ctx.config.finegrained_tp_config.lmhead_tensor_parallel_size > 0:
        out.error(key, "cannot be combined with finegrained_tp_config.lmhead_tensor_parallel_size")
    if ctx.engine.is_prefill_node:
        out.error(key, "not supported on a PD-disaggregated prefill node (kv_role "
                       "\"kv_producer\")")
    out.warn(key, "experimental; logprobs are computed over partitioned logits and are wrong")


RULES = (kvpp, finegrained_tp, mc2, shared_experts, dsa_cp_turns_on_flashcomm, reduce_sample)
