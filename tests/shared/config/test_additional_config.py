"""--additional-config: every seed example parses; bad input fails naming the key.

The seed examples were copied by hand into ``seed_examples`` (each with the seed file
and line it came from); tests never read ../shared.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdmesh.shared.config import AdditionalConfig, ConfigError, EngineArgs, parse_additional_config
from pdmesh.shared.config.options import schema_fields, spec_of
from tests.shared.config.seed_examples import OTHER_JSON, SEED_CASES, SeedCase

PARSED_CASES = [c for c in SEED_CASES if not c.rejected_keys]
REJECTED_CASES = [c for c in SEED_CASES if c.rejected_keys]


def parse(raw, *, engine: EngineArgs | None = None, env: dict | None = None,
          device: str = "npu") -> AdditionalConfig:
    return parse_additional_config(raw, env=env or {}, device=device, engine_args=engine)


def problems_of(raw, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(raw, **kwargs)
    return info.value


# ---- the seed documents --------------------------------------------------------------


@pytest.mark.parametrize("device", ["npu", "cpu"])
@pytest.mark.parametrize("case", PARSED_CASES, ids=lambda c: c.name)
def test_seed_example_parses(case: SeedCase, device: str) -> None:
    config = parse(case.raw, engine=case.engine, env=case.env, device=device)
    assert isinstance(config, AdditionalConfig)


@pytest.mark.parametrize("case", REJECTED_CASES, ids=lambda c: c.name)
def test_seed_placeholder_is_rejected_as_unknown_key(case: SeedCase) -> None:
    error = problems_of(case.raw, engine=case.engine, env=case.env)
    assert error.keys == case.rejected_keys
    assert "unknown key at the top level" in str(error)


def test_seed_values_resolve_as_the_recipes_mean() -> None:
    cases = {c.name: c for c in SEED_CASES}

    def run(name: str) -> AdditionalConfig:
        c = cases[name]
        return parse(c.raw, engine=c.engine, env=c.env)

    single = run("dsv4_single_node")
    assert single.enable_cpu_binding is True  # "true", quoted in the recipe
    assert single.enable_fused_mc2 == 1  # $VLLM_ASCEND_ENABLE_FUSED_MC2=1
    assert single.enable_flashcomm1 is True  # $VLLM_ASCEND_ENABLE_FLASHCOMM1=1
    assert single.eplb_config.dynamic_eplb is True  # $DYNAMIC_EPLB=true
    assert single.ascend_compilation_config.enable_static_kernel is False
    assert any('"true" was read as the boolean true' in w for w in single.warnings)

    decode = run("dsv4_pd_decode")
    assert decode.scheduler_config.recompute_scheduler_enable is True
    assert any("recompute_scheduler_enable: deprecated top-level key; write it as "
               "scheduler_config.recompute_scheduler_enable" in w for w in decode.warnings)

    prefill = run("dsv4_pd_prefill")
    assert prefill.enable_dsa_cp and prefill.enable_flashcomm1

    assert run("ac_rl_same_device").weight_nz_mode == 0  # RL mode forces it
    full = run("ac_full_example")
    assert full.dynamic_spec_config.method_params.budget_update_interval == 50
    assert full.dynamic_spec_config.method_params.min_verify_tokens == 1  # default

    torchair = run("features_torchair")
    assert torchair.inactive_keys == ("chunked_prefill_for_mla", "enable_weight_nz_layout",
                                      "torchair_graph_config")


@pytest.mark.parametrize("source,flag,text", OTHER_JSON, ids=lambda v: str(v)[:40])
def test_other_seed_json_flags_are_json(source: str, flag: str, text: str) -> None:
    assert isinstance(json.loads(text), dict)


def test_seed_kv_roles_match_their_kv_transfer_config() -> None:
    for case in SEED_CASES:
        if case.kv_transfer_config:
            assert json.loads(case.kv_transfer_config)["kv_role"] == case.engine.kv_role


# ---- the schema ----------------------------------------------------------------------


def test_defaults_are_vllm_ascend_defaults() -> None:
    config = parse("{}")
    lb = config.scheduler_config.dyntra_lb_config
    assert (lb.enabled, lb.enable_diagnostics, lb.mode, lb.start_step, lb.end_step,
            lb.bubble_threshold, lb.long_req_block_threshold, lb.dynamic_max_step) == (
        False, False, "dynamic", 250, -1, 5.0, 700, 256)
    srf = config.scheduler_config.short_request_first_config
    assert (srf.enabled, srf.threshold, srf.long_max_wait_ms) == (False, 256, 0.0)
    assert config.eplb_config.load_collection_phase == "all"
    assert config == AdditionalConfig()
    assert config.warnings == () and config.inactive_keys == ()


def test_every_key_has_a_doc_and_an_allowed_default() -> None:
    def walk(cls: type) -> int:
        count = 0
        for f in schema_fields(cls):
            spec = spec_of(f)
            assert spec is not None and spec.doc, f.name
            default = getattr(cls(), f.name)
            if dataclasses.is_dataclass(default):
                count += walk(type(default))
            else:
                assert spec.violation(default) is None, f.name
                count += 1
        return count

    assert walk(AdditionalConfig) > 100


def test_config_is_frozen() -> None:
    config = parse("{}")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.scheduler_config.dyntra_lb_config.enabled = True  # type: ignore[misc]


# ---- errors: each names the key --------------------------------------------------------


def test_invalid_json_names_the_position() -> None:
    error = problems_of('{"refresh": true,\n "enable_kv_nz": }')
    assert "invalid JSON at line 2 column 18" in str(error)


def test_python_dict_syntax_gets_a_hint() -> None:
    error = problems_of("{'refresh': True}")
    assert "looks like a Python dict" in str(error)


@pytest.mark.parametrize("raw,expected", [
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"refresh": NaN}', "NaN is not a number JSON allows"),
    ('{"refresh": true, "refresh": false}', "key given twice"),
])
def test_malformed_top_level(raw: str, expected: str) -> None:
    assert expected in str(problems_of(raw))


@pytest.mark.parametrize("raw,key,suggestion", [
    ({"enabel_kvpp": True}, "enabel_kvpp", "enable_kvpp"),
    ({"scheduler_config": {"dyntra_lb_config": {"bubble_treshold": 3.0}}},
     "scheduler_config.dyntra_lb_config.bubble_treshold",
     "scheduler_config.dyntra_lb_config.bubble_threshold"),
    ({"dyntra_lb_config": {"enabled": True}}, "dyntra_lb_config",
     "scheduler_config.dyntra_lb_config"),
    ({"eplb_config": {"load_colection_phase": "all"}}, "eplb_config.load_colection_phase",
     "eplb_config.load_collection_phase"),
    ({"quest_decode_config": {"enabled": True}}, "quest_decode_config.enabled",
     "quest_decode_config.enable"),
    ({"torchair_graph_config": {"enable": True}}, "torchair_graph_config.enable",
     "torchair_graph_config.enabled"),
])
def test_unknown_key_names_path_and_closest_key(raw, key: str, suggestion: str) -> None:
    error = problems_of(raw)
    assert error.keys == (key,)
    assert f"did you mean {suggestion}?" in str(error)


@pytest.mark.parametrize("raw,key,got,expected", [
    ({"scheduler_config": {"dyntra_lb_config": {"enabled": "yes"}}},
     "scheduler_config.dyntra_lb_config.enabled", 'string "yes"', "a boolean"),
    ({"refresh": 1}, "refresh", "integer 1", "a boolean"),
    ({"weight_nz_mode": "2"}, "weight_nz_mode", 'string "2"', "an integer"),
    ({"weight_nz_mode": 1.0}, "weight_nz_mode", "number 1.0", "an integer"),
    ({"rejection_sampler_config": {"posterior_alpha": "0.5"}},
     "rejection_sampler_config.posterior_alpha", 'string "0.5"', "a number"),
    ({"pa_shape_list": 16}, "pa_shape_list", "integer 16", "a list of integers"),
    ({"pa_shape_list": [16, "32"]}, "pa_shape_list[1]", 'string "32"', "an integer"),
    ({"scheduler_config": True}, "scheduler_config", "boolean true", "an object"),
    ({"mega_moe_max_tokens": None}, "mega_moe_max_tokens", "null", "an integer"),
    ({"eplb_config": {"expert_map_path": 5}}, "eplb_config.expert_map_path", "integer 5",
     "a string or null"),
])
def test_wrong_type_names_key_value_and_expectation(raw, key, got, expected) -> None:
    error = problems_of(raw)
    assert error.keys == (key,)
    assert f"expected {expected}" in str(error) and f"got {got}" in str(error)


@pytest.mark.parametrize("raw,key,expected", [
    ({"scheduler_config": {"dyntra_lb_config": {"bubble_threshold": 0}}},
     "scheduler_config.dyntra_lb_config.bubble_threshold", "must be > 0, got 0"),
    ({"scheduler_config": {"dyntra_lb_config": {"mode": "dinamic"}}},
     "scheduler_config.dyntra_lb_config.mode", 'must be one of "dynamic", "static", got '
                                               '"dinamic"'),
    ({"scheduler_config": {"dyntra_lb_config": {"end_step": -2}}},
     "scheduler_config.dyntra_lb_config.end_step", "must be >= -1, got -2"),
    ({"rejection_sampler_config": {"posterior_threshold": 1.5}},
     "rejection_sampler_config.posterior_threshold", "must be > 0 and <= 1, got 1.5"),
    ({"eplb_config": {"eplb_policy_type": 4}}, "eplb_config.eplb_policy_type",
     "must be one of 0, 1, 2, 3, got 4"),
    ({"eplb_config": {"expert_map_path": "/maps/map.txt"}}, "eplb_config.expert_map_path",
     "must be a path ending in '.json'"),
    ({"quest_decode_config": {"topk_pages": 12}}, "quest_decode_config.topk_pages",
     "must be >= 8 and a multiple of 8, got 12"),
    ({"scheduler_config": {"short_request_first_config": {"threshold": -1}}},
     "scheduler_config.short_request_first_config.threshold", "must be >= 0, got -1"),
])
def test_out_of_range_names_key_value_and_range(raw, key: str, expected: str) -> None:
    error = problems_of(raw)
    assert error.keys == (key,)
    assert expected in str(error)


def test_every_problem_is_listed_at_once() -> None:
    error = problems_of({
        "enabel_kvpp": True,
        "weight_nz_mode": 5,
        "scheduler_config": {"dyntra_lb_config": {"enabled": True, "mode": "x"}},
    })
    assert set(error.keys) == {"enabel_kvpp", "weight_nz_mode",
                               "scheduler_config.dyntra_lb_config.mode",
                               "scheduler_config.dyntra_lb_config.enabled"}
    assert str(error).startswith("invalid --additional-config (5 problems):")


def test_quoted_booleans_are_read_with_a_warning() -> None:
    config = parse({"enable_cpu_binding": "False", "refresh": "TRUE"})
    assert config.enable_cpu_binding is False and config.refresh is True
    assert len([w for w in config.warnings if "write" in w and "without quotes" in w]) == 2


def test_unknown_device_is_rejected() -> None:
    assert problems_of("{}", device="auto").keys == ("device",)


# ---- what vLLM-Ascend accepts beyond plain JSON types --------------------------------


@pytest.mark.parametrize("raw", [
    {"scheduler_config": None},
    {"scheduler_config": {"dyntra_lb_config": None}},
    {"scheduler_config": {"short_request_first_config": None, "dyntra_lb_config": None}},
])
def test_a_null_section_is_its_defaults(raw) -> None:
    config = parse(raw)
    assert config.scheduler_config == AdditionalConfig().scheduler_config
    assert not config.warnings


@pytest.mark.parametrize("given,read", [
    ({"threshold": "256"}, {"threshold": 256}),
    ({"threshold": 256.7}, {"threshold": 256}),  # int() truncates, as vLLM-Ascend's does
    ({"enabled": 1}, {"enabled": True}),
    ({"enabled": 0}, {"enabled": False}),
    ({"long_max_wait_ms": "12.5"}, {"long_max_wait_ms": 12.5}),
])
def test_short_request_first_takes_what_vllm_ascends_casts_take(given, read) -> None:
    srf = {"short_request_first_config": given}
    config = parse({"scheduler_config": srf}, engine=EngineArgs(kv_role=None))
    got = config.scheduler_config.short_request_first_config
    assert {k: getattr(got, k) for k in read} == read
    (key,) = given
    assert any(f"short_request_first_config.{key}" in w and "vLLM-Ascend casts" in w
               for w in config.warnings)


@pytest.mark.parametrize("given", [{"threshold": "256.7"}, {"threshold": True},
                                   {"enabled": "yes"}, {"long_max_wait_ms": "soon"},
                                   {"threshold": None}])
def test_short_request_first_refuses_what_the_casts_refuse(given) -> None:
    (key,) = given
    error = problems_of({"scheduler_config": {"short_request_first_config": given}})
    assert error.keys == (f"scheduler_config.short_request_first_config.{key}",)


@pytest.mark.parametrize("given", [{"start_step": "256"}, {"start_step": 256.7},
                                   {"enabled": 1}, {"bubble_threshold": "5"}])
def test_dyntra_lb_stays_as_strict_as_vllm_ascends(given) -> None:
    (key,) = given
    error = problems_of({"scheduler_config": {"dyntra_lb_config": given}})
    assert error.keys == (f"scheduler_config.dyntra_lb_config.{key}",)


def test_recompute_false_as_a_string_stays_off_and_says_vllm_ascend_differs() -> None:
    config = parse({"scheduler_config": {"recompute_scheduler_enable": "false"}},
                   engine=EngineArgs(kv_role="kv_consumer"))
    assert config.scheduler_config.recompute_scheduler_enable is False
    assert any("recompute_scheduler_enable" in w and "turns it on there" in w
               for w in config.warnings)
