"""Forbidden combinations fail at parse time naming the key; resolved values are applied."""

from __future__ import annotations

import pytest

from pdmesh.shared.config import AdditionalConfig, ConfigError, EngineArgs, parse_additional_config

DECODE = EngineArgs(kv_role="kv_consumer", data_parallel_size=4, enable_expert_parallel=True)
PREFILL = EngineArgs(kv_role="kv_producer", data_parallel_size=2)
MIXED = EngineArgs(data_parallel_size=2)
MRV1_EP = EngineArgs(enable_expert_parallel=True, data_parallel_size=2, model_runner_v2=False)
MRV2_EP = EngineArgs(enable_expert_parallel=True, data_parallel_size=2, model_runner_v2=True)


def parse(raw, engine: EngineArgs = MIXED, env: dict | None = None) -> AdditionalConfig:
    return parse_additional_config(raw, env=env or {}, device="npu", engine_args=engine)


def sched(**keys) -> dict:
    return {"scheduler_config": keys}


DYNTRA_ON = sched(dyntra_lb_config={"enabled": True})
SRF_ON = {"enabled": True}

FORBIDDEN = [
    # DyntraLB: decode node, DP > 1, one node (seed additional-config.zh.txt:62; guide).
    ("dyntra_on_mixed", DYNTRA_ON, MIXED, None,
     "scheduler_config.dyntra_lb_config.enabled", "kv_role is unset"),
    ("dyntra_on_prefill", DYNTRA_ON, PREFILL, None,
     "scheduler_config.dyntra_lb_config.enabled", 'kv_role is "kv_producer"'),
    ("dyntra_dp1", DYNTRA_ON, EngineArgs(kv_role="kv_consumer"), None,
     "scheduler_config.dyntra_lb_config.enabled", "needs data_parallel_size > 1, got 1"),
    ("dyntra_multi_node", DYNTRA_ON,
     EngineArgs(kv_role="kv_consumer", data_parallel_size=4, data_parallel_size_local=2), None,
     "scheduler_config.dyntra_lb_config.enabled", "every DP rank of the decode instance"),
    ("dyntra_balance", sched(dyntra_lb_config={"enabled": True},
                             enable_balance_scheduling=True), DECODE, None,
     "scheduler_config.dyntra_lb_config.enabled", "scheduler_config.enable_balance_scheduling"),
    ("dyntra_profiling_chunk", sched(dyntra_lb_config={"enabled": True},
                                     profiling_chunk_config={"enabled": True}),
     EngineArgs(kv_role="kv_consumer", data_parallel_size=4, pipeline_parallel_size=2), None,
     "scheduler_config.dyntra_lb_config.enabled", "profiling_chunk_config.enabled"),
    ("dyntra_empty_window", sched(dyntra_lb_config={"start_step": 300, "end_step": 300}),
     MIXED, None, "scheduler_config.dyntra_lb_config.end_step", "greater than start_step=300"),
    # Recompute: error on PD-mixed (no kv_role or kv_both).
    ("recompute_mixed", sched(recompute_scheduler_enable=True), MIXED, None,
     "scheduler_config.recompute_scheduler_enable", "not supported on a PD-mixed instance"),
    ("recompute_kv_both", sched(recompute_scheduler_enable=True),
     EngineArgs(kv_role="kv_both"), None,
     "scheduler_config.recompute_scheduler_enable", 'kv_role is "kv_both"'),
    ("recompute_legacy_mixed", {"recompute_scheduler_enable": True}, MIXED, None,
     "recompute_scheduler_enable", "PD-mixed"),
    # ShortRequestFirst (seed additional-config.zh.txt:78; priority: FCFS only).
    ("srf_decode", sched(short_request_first_config=SRF_ON), DECODE, None,
     "scheduler_config.short_request_first_config.enabled", "decode node"),
    ("srf_priority", sched(short_request_first_config=SRF_ON),
     EngineArgs(scheduling_policy="priority"), None,
     "scheduler_config.short_request_first_config.enabled", "--scheduling-policy priority"),
    ("srf_batch_job", sched(short_request_first_config=SRF_ON,
                            batch_job_sched_config={"enabled": True}), MIXED, None,
     "scheduler_config.short_request_first_config.enabled", "batch_job_sched_config.enabled"),
    ("srf_profiling_chunk", sched(short_request_first_config=SRF_ON,
                                  profiling_chunk_config={"enabled": True}),
     EngineArgs(pipeline_parallel_size=2), None,
     "scheduler_config.short_request_first_config.enabled", "profiling_chunk_config.enabled"),
    # Balance scheduling and profiling-chunk.
    ("balance_on_decode", sched(enable_balance_scheduling=True), DECODE, None,
     "scheduler_config.enable_balance_scheduling", "only runs on PD-mixed"),
    ("profiling_chunk_pp1", sched(profiling_chunk_config={"enabled": True}), MIXED, None,
     "scheduler_config.profiling_chunk_config.enabled", "pipeline_parallel_size > 1, got 1"),
    # EPLB: one schema per model runner, no mixing (seed additional-config.zh.txt:49-52).
    ("eplb_legacy_with_upstream", {"eplb_config": {"dynamic_eplb": True}},
     EngineArgs(enable_expert_parallel=True, enable_eplb=True, model_runner_v2=False), None,
     "eplb_config.dynamic_eplb", "cannot be mixed with upstream --enable-eplb"),
    ("eplb_legacy_with_upstream_config", {"eplb_config": {"num_redundant_experts": 2}},
     EngineArgs(enable_expert_parallel=True, eplb_config={"num_redundant_experts": 2},
                model_runner_v2=True), None,
     "eplb_config.num_redundant_experts", "cannot be mixed with upstream"),
    ("eplb_upstream_on_mrv1", {}, EngineArgs(enable_expert_parallel=True, enable_eplb=True,
                                             model_runner_v2=False), None,
     "--enable-eplb", "not accepted by Model Runner V1"),
    ("eplb_legacy_on_mrv2", {"eplb_config": {"eplb_policy_type": 1}}, MRV2_EP, None,
     "eplb_config.eplb_policy_type", "Model Runner V2 accepts only"),
    ("eplb_env_on_mrv2", {}, MRV2_EP, {"DYNAMIC_EPLB": "true"},
     "eplb_config.dynamic_eplb (from $DYNAMIC_EPLB)", "Model Runner V2 accepts only"),
    ("eplb_phase_on_mrv1", {"eplb_config": {"load_collection_phase": "decode"}}, MRV1_EP, None,
     "eplb_config.load_collection_phase", "only Model Runner V2"),
    ("eplb_phase_without_upstream", {"eplb_config": {"load_collection_phase": "decode"}},
     MRV2_EP, None, "eplb_config.load_collection_phase", "needs upstream --enable-eplb"),
    ("eplb_without_ep", {}, EngineArgs(enable_eplb=True, model_runner_v2=True), None,
     "--enable-eplb", "needs --enable-expert-parallel"),
    ("force_eplb_dynamic", {"enable_force_eplb": True, "eplb_config": {"dynamic_eplb": True}},
     MRV1_EP, None, "enable_force_eplb", "eplb_config.dynamic_eplb"),
    # KVPP (seed additional-config.zh.txt:159).
    ("kvpp_connector", {"enable_kvpp": True},
     EngineArgs(kv_role="kv_producer", enforce_eager=True), None,
     "enable_kvpp", "KV transfer connector"),
    ("kvpp_graph_mode", {"enable_kvpp": True}, MIXED, None, "enable_kvpp", "--enforce-eager"),
    ("kvpp_dcp", {"enable_kvpp": True},
     EngineArgs(enforce_eager=True, decode_context_parallel_size=2), None,
     "enable_kvpp", "does not support DCP"),
    ("kvpp_pcp_mrv1", {"enable_kvpp": True},
     EngineArgs(enforce_eager=True, prefill_context_parallel_size=2, model_runner_v2=False),
     None, "enable_kvpp", "needs Model Runner V2"),
    # Dynamic speculative decoding needs the same speculative method (seed :70).
    ("dynamic_spec_no_spec", {"dynamic_spec_config": {"method": "dflash"}}, MIXED, None,
     "dynamic_spec_config.method", 'method "dflash", but the speculative method is unset'),
    # MTP drafts have no confidence head for dspark
    ("dspark_on_mtp", {"dynamic_spec_config": {"method": "dspark"}},
     EngineArgs(speculative_method="deepseek_mtp"), None, "dynamic_spec_config.method",
     "dspark needs a draft model with a confidence head"),
    # vLLM-Ascend code checks (ascend_config.py / platform.py).
    ("static_kernel", {"ascend_compilation_config": {"enable_npugraph_ex": False,
                                                     "enable_static_kernel": True}}, MIXED,
     None, "ascend_compilation_config.enable_static_kernel", "enable_npugraph_ex: true"),
    ("kv_nz_prefill", {"enable_kv_nz": True}, PREFILL, None, "enable_kv_nz", "decode nodes"),
    ("c8_reshape", {"c8_enable_reshape_optim": True}, PREFILL, None,
     "c8_enable_reshape_optim", "needs enable_sparse_li_c8"),
    ("finegrained_divides_dp", {"finegrained_tp_config": {"mlp_tensor_parallel_size": 3}},
     DECODE, None, "finegrained_tp_config.mlp_tensor_parallel_size", "must divide"),
    ("oproj_on_prefill", {"finegrained_tp_config": {"oproj_tensor_parallel_size": 2}},
     PREFILL, None, "finegrained_tp_config.oproj_tensor_parallel_size", "decode nodes"),
    ("finegrained_beside_tp", {"finegrained_tp_config": {"mlp_tensor_parallel_size": 2}},
     EngineArgs(data_parallel_size=2, tensor_parallel_size=2), None,
     "finegrained_tp_config.mlp_tensor_parallel_size", "needs tensor_parallel_size 1"),
    ("hierarchy_fused_mc2", {"mc2_comm_alg": "hierarchy", "enable_fused_mc2": 1}, MIXED, None,
     "enable_fused_mc2", "hierarchy"),
    ("hierarchy_conflict", {"enable_mc2_hierarchy_comm": True, "mc2_comm_alg": "fullmesh"},
     MIXED, None, "enable_mc2_hierarchy_comm", 'mc2_comm_alg is "fullmesh"'),
    ("mix_placement", {"mix_placement": True, "multistream_overlap_shared_expert": True},
     MIXED, None, "mix_placement", "multistream_overlap_shared_expert"),
    ("reduce_sample_lmhead", {"enable_reduce_sample": True,
                              "finegrained_tp_config": {"lmhead_tensor_parallel_size": 2}},
     MIXED, None, "enable_reduce_sample", "lmhead_tensor_parallel_size"),
    ("mlapo_keep", {"enable_mlapo": False, "mlapo_keep_prefill_weights": True}, MIXED, None,
     "mlapo_keep_prefill_weights", "enable_mlapo"),
    ("dump_both", {"dump_config": {"task": "tensor"}, "dump_config_path": "/d.json"}, MIXED,
     None, "dump_config", "not both"),
    ("quest_topk", {"quest_decode_config": {"enable": True}}, MIXED, None,
     "quest_decode_config.topk_pages", "required"),
    ("sparse_offload_prefill", {"sparse_kv_offload_config": {"enabled": True}}, PREFILL, None,
     "sparse_kv_offload_config.enabled", "decode nodes"),
    ("xlite_pp", {"xlite_graph_config": {"enabled": True}},
     EngineArgs(pipeline_parallel_size=2), None, "xlite_graph_config.enabled", "pipeline"),
    ("abort_timeout", {"ft_communication_abort_timeout": 1}, MIXED, None,
     "ft_communication_abort_timeout", "at least 2 seconds"),
]


@pytest.mark.parametrize("raw,engine,env,key,words", [f[1:] for f in FORBIDDEN],
                         ids=[f[0] for f in FORBIDDEN])
def test_forbidden_combination_names_the_key(raw, engine, env, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(raw, engine, env)
    assert key in info.value.keys, str(info.value)
    message = next(str(p) for p in info.value.problems if p.key == key)
    assert message.startswith(f"{key}: ") and words in message, message


def test_dyntra_lb_with_recompute_on_a_decode_node_parses() -> None:
    config = parse(sched(dyntra_lb_config={"enabled": True, "mode": "static"},
                         recompute_scheduler_enable=True), DECODE)
    assert config.scheduler_config.dyntra_lb_config.enabled
    assert config.scheduler_config.recompute_scheduler_enable


def test_dflash_budgets_mtp_drafts_with_a_warning_saying_so() -> None:
    config = parse({"dynamic_spec_config": {"method": "dflash", "method_params": {
        "budget_threshold": 0.7}}}, EngineArgs(speculative_method="mtp"))
    assert config.dynamic_spec_config.method_params.budget_threshold == 0.7
    assert any(w.startswith('dynamic_spec_config.method: budgets the "mtp" drafts')
               for w in config.warnings), config.warnings


def test_sparse_kv_offload_on_a_decode_node_says_why_it_is_without_effect() -> None:
    config = parse({"sparse_kv_offload_config": {"enabled": True}}, DECODE)
    assert any(w.startswith("sparse_kv_offload_config.enabled: without effect: pdmesh keeps "
                            "DeepSeek-V4's compressed history") and "--enable-hierarchical"
               in w for w in config.warnings), config.warnings


def test_recompute_on_a_prefill_node_is_switched_off_with_a_warning() -> None:
    config = parse(sched(recompute_scheduler_enable=True), PREFILL)
    assert config.scheduler_config.recompute_scheduler_enable is False
    assert any(w.startswith("scheduler_config.recompute_scheduler_enable: ignored on a prefill")
               for w in config.warnings)


def test_short_request_first_on_a_prefill_node_parses() -> None:
    config = parse(sched(short_request_first_config={"enabled": True, "threshold": 512}),
                   PREFILL)
    assert config.scheduler_config.short_request_first_config.threshold == 512


def test_eplb_each_runner_accepts_its_own_schema() -> None:
    v1 = parse({"eplb_config": {"dynamic_eplb": True, "num_redundant_experts": 16}}, MRV1_EP)
    assert v1.eplb_config.num_redundant_experts == 16
    v2 = parse({"eplb_config": {"load_collection_phase": "decode"}},
               EngineArgs(enable_expert_parallel=True, enable_eplb=True, model_runner_v2=True))
    assert v2.eplb_config.load_collection_phase == "decode"


def test_model_runner_comes_from_the_environment_when_not_given() -> None:
    raw = {"eplb_config": {"load_collection_phase": "prefill"}}
    engine = EngineArgs(enable_expert_parallel=True, enable_eplb=True)
    assert parse(raw, engine, {"VLLM_USE_V2_MODEL_RUNNER": "1"}).eplb_config
    with pytest.raises(ConfigError):
        parse(raw, engine, {})


def test_all_rule_failures_are_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        parse({"scheduler_config": {"dyntra_lb_config": {"enabled": True},
                                    "recompute_scheduler_enable": True},
               "enable_kvpp": True}, MIXED)
    assert set(info.value.keys) == {"scheduler_config.dyntra_lb_config.enabled",
                                    "scheduler_config.recompute_scheduler_enable",
                                    "enable_kvpp"}


@pytest.mark.parametrize("raw,engine,path,value,warned", [
    # need_timing follows enabled when unset (code: ProfilingChunkConfig).
    (sched(profiling_chunk_config={"enabled": True}), EngineArgs(pipeline_parallel_size=2),
     "scheduler_config.profiling_chunk_config.need_timing", True, False),
    (sched(profiling_chunk_config={"need_timing": True}), MIXED,
     "scheduler_config.profiling_chunk_config.need_timing", False, True),
    # RL mode forces weight_nz_mode 0 (seed additional-config.zh.txt:86).
    ({"rl_config": {"enabled": True}, "weight_nz_mode": 2}, MIXED, "weight_nz_mode", 0, True),
    # Recording an expert map runs dynamic EPLB (code: EplbConfig).
    ({"eplb_config": {"expert_map_record_path": "/maps/out.json"}}, MRV1_EP,
     "eplb_config.dynamic_eplb", True, False),
    # Fused MC2 switches the shared-expert stream off (code).
    ({"enable_fused_mc2": 1, "multistream_overlap_shared_expert": True}, MIXED,
     "multistream_overlap_shared_expert", False, True),
    # The old hierarchy switch is mc2_comm_alg "hierarchy" (code).
    ({"enable_mc2_hierarchy_comm": True}, MIXED, "mc2_comm_alg", "hierarchy", True),
    # Shared-expert DP needs EP and TP > 1 (code).
    ({"enable_shared_expert_dp": True}, MIXED, "enable_shared_expert_dp", False, True),
    # DSA-CP turns FlashComm1 on (code).
    ({"enable_dsa_cp": True}, MIXED, "enable_flashcomm1", True, True),
])
def test_resolved_values(raw, engine, path: str, value, warned: bool) -> None:
    config = parse(raw, engine)
    got = config
    for name in path.split("."):
        got = getattr(got, name)
    assert got == value
    # (keys pdmesh validates but does not act on are listed as such: not what this checks)
    said = [w for w in config.warnings if "does not implement yet" not in w]
    if warned:
        assert any(path.rpartition(".")[2] in w for w in said), config.warnings
    else:
        assert said == []


def test_rl_mode_disabled_ignores_its_other_fields_with_a_warning() -> None:
    config = parse({"rl_config": {"enabled": False, "enable_batch_invariant": True}})
    assert config.warnings[0] == (
        "rl_config.enable_batch_invariant: without effect while rl_config.enabled is false")
    assert config.warnings[1:] == ("1 key(s) set vLLM-Ascend's own graph passes, fused "
                                   "operators, communication or runtime, which pdmesh's npu "
                                   "backend does not implement; without effect: rl_config",)


@pytest.mark.parametrize(("raw", "said"), [
    ({"scheduler_config": {"dyntra_lb_config": {"mode": "static", "start_step": 3}}},
     "scheduler_config.dyntra_lb_config.mode, scheduler_config.dyntra_lb_config.start_step: "
     "without effect while scheduler_config.dyntra_lb_config.enabled is false"),
    ({"short_request_first_config": {"threshold": 64, "long_max_wait_ms": 5}},
     "short_request_first_config.long_max_wait_ms, short_request_first_config.threshold: "
     "without effect while short_request_first_config.enabled is false"),
    ({"xlite_graph_config": {"full_mode": True}},
     "xlite_graph_config.full_mode: without effect while xlite_graph_config.enabled is false"),
])
def test_keys_of_a_switched_off_section_are_said_to_be_without_effect(raw, said) -> None:
    """Each section's keys act only with its switch on; set with it off, they are named
    (as the user spelled them: the old top-level spelling too) rather than dropped."""
    config = parse(raw)
    assert said in config.warnings, config.warnings
    on = parse({"scheduler_config": {"dyntra_lb_config": {"enabled": True, "mode": "static"}}},
               EngineArgs(kv_role="kv_consumer", data_parallel_size=2))
    assert not any("without effect while" in w for w in on.warnings), on.warnings


def test_enable_eplb_without_eplb_config_reads_the_collection_phase(tmp_path) -> None:
    """Upstream --enable-eplb (Model Runner V2) with no --eplb-config still takes
    eplb_config.load_collection_phase, and upstream's window."""
    from pdmesh.shared.config.serve import serve_config

    c = serve_config("serve", [str(tmp_path), "--data-parallel-size", "2",
                               "--enable-expert-parallel", "--enable-eplb",
                               "--additional-config",
                               '{"eplb_config": {"load_collection_phase": "decode"}}'],
                     env={"VLLM_USE_V2_MODEL_RUNNER": "1"}, device="cpu")
    assert c.engine.expert_load_phase == "decode" and c.engine.expert_load_window == 1000
