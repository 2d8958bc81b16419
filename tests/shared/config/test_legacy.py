"""Deprecated keys and environment variables still work, with a warning naming the new
spelling; the newer spelling wins. Removed keys and Ascend-only keys are reported."""

from __future__ import annotations

import pytest

from pdmesh.shared.config import AdditionalConfig, ConfigError, EngineArgs, parse_additional_config
from pdmesh.shared.config.legacy import ENV_VARS, MOVED_KEYS, REMOVED_KEYS

DECODE = EngineArgs(kv_role="kv_consumer", data_parallel_size=2)
PIPELINE = EngineArgs(pipeline_parallel_size=2)


def parse(raw, *, engine: EngineArgs | None = None, env: dict | None = None,
          device: str = "npu") -> AdditionalConfig:
    return parse_additional_config(raw, env=env or {}, device=device, engine_args=engine)


def value_at(config: AdditionalConfig, path: str):
    for name in path.split("."):
        config = getattr(config, name)
    return config


# A value for each moved key that differs from its default, and an engine it may run on.
MOVED_VALUES = {
    "enable_balance_scheduling": (True, None, True),
    "recompute_scheduler_enable": (True, DECODE, True),
    "short_request_first_config": ({"enabled": True, "threshold": 64}, None, 64),
    "profiling_chunk_config": ({"enabled": True, "min_chunk": 1024}, PIPELINE, 1024),
    "batch_job_sched_config": ({"enabled": True, "max_jobs": 4}, None, 4),
    "enable_npugraph_ex": (False, None, False),
}
LEAF = {"short_request_first_config": ".threshold", "profiling_chunk_config": ".min_chunk",
        "batch_job_sched_config": ".max_jobs"}


def test_every_moved_key_is_covered() -> None:
    assert set(MOVED_VALUES) == set(MOVED_KEYS)


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_deprecated_top_level_key_still_works(old: str) -> None:
    value, engine, effective = MOVED_VALUES[old]
    new = MOVED_KEYS[old]
    config = parse({old: value}, engine=engine)
    assert value_at(config, new + LEAF.get(old, "")) == effective
    assert f"{old}: deprecated top-level key; write it as {new}" in config.warnings


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_new_spelling_wins_over_the_deprecated_one(old: str) -> None:
    value, engine, _ = MOVED_VALUES[old]
    new = MOVED_KEYS[old]
    section, _, leaf = new.partition(".")
    default = value_at(AdditionalConfig(), new)
    written = {} if isinstance(value, dict) else default
    config = parse({old: value, section: {leaf: written}}, engine=engine)
    assert value_at(config, new) == value_at(parse({section: {leaf: written}}), new)
    assert f"{old}: deprecated, and ignored because {new} is also set ({new} wins)" \
        in config.warnings


def test_a_typo_inside_an_ignored_deprecated_key_is_still_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        parse({"short_request_first_config": {"treshold": 1},
               "scheduler_config": {"short_request_first_config": {}}})
    assert info.value.keys == ("short_request_first_config.treshold",)
    assert "did you mean scheduler_config.short_request_first_config.threshold?" \
        in str(info.value)


def test_errors_in_a_deprecated_key_name_it_as_written() -> None:
    with pytest.raises(ConfigError) as info:
        parse({"short_request_first_config": {"enabled": "on"}})
    assert info.value.keys == ("short_request_first_config.enabled",)


# A value for each environment variable and the effective value it gives.
ENV_VALUES = {
    "VLLM_ASCEND_BALANCE_SCHEDULING": ("1", True),
    "VLLM_ASCEND_ENABLE_FLASHCOMM1": ("1", True),
    "VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE": ("true", True),
    "VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE": ("4", 4),
    "MSMONITOR_USE_DAEMON": ("1", True),
    "VLLM_ASCEND_ENABLE_MLAPO": ("0", False),
    "VLLM_ASCEND_ENABLE_NZ": ("2", 2),
    "VLLM_ASCEND_ENABLE_CONTEXT_PARALLEL": ("1", True),
    "VLLM_ASCEND_ENABLE_FUSED_MC2": ("1", 1),
    "VLLM_ASCEND_FUSION_OP_TRANSPOSE_KV_CACHE_BY_BLOCK": ("0", False),
    "DYNAMIC_EPLB": ("TRUE", True),
}
EP = EngineArgs(enable_expert_parallel=True)


def test_every_env_var_is_covered() -> None:
    assert set(ENV_VALUES) == set(ENV_VARS)


@pytest.mark.parametrize("var", sorted(ENV_VARS))
def test_env_var_still_works_with_a_warning(var: str) -> None:
    text, effective = ENV_VALUES[var]
    key = ENV_VARS[var].key
    config = parse("{}", env={var: text}, engine=EP)
    assert value_at(config, key) == effective
    assert any(w.startswith(f"${var}: deprecated environment variable; write {key} = ")
               for w in config.warnings), config.warnings


@pytest.mark.parametrize("var", sorted(ENV_VARS))
def test_additional_config_wins_over_env_var(var: str) -> None:
    text, effective = ENV_VALUES[var]
    key = ENV_VARS[var].key
    written = value_at(AdditionalConfig(), key)
    raw: dict = {}
    node = raw
    *parents, leaf = key.split(".")
    for name in parents:
        node = node.setdefault(name, {})
    node[leaf] = written
    config = parse(raw, env={var: text}, engine=EP)
    assert value_at(config, key) == written != effective
    assert f"${var}: deprecated and ignored because --additional-config sets {key} (the " \
           f"additional-config value wins)" in config.warnings


def test_precedence_is_new_path_then_legacy_key_then_env() -> None:
    env = {"VLLM_ASCEND_BALANCE_SCHEDULING": "1"}
    legacy = parse({"enable_balance_scheduling": False}, env=env)
    assert legacy.scheduler_config.enable_balance_scheduling is False
    new = parse({"enable_balance_scheduling": True,
                 "scheduler_config": {"enable_balance_scheduling": False}}, env=env)
    assert new.scheduler_config.enable_balance_scheduling is False


@pytest.mark.parametrize("var,text,key", [
    ("VLLM_ASCEND_ENABLE_NZ", "yes", "weight_nz_mode (from $VLLM_ASCEND_ENABLE_NZ)"),
    ("VLLM_ASCEND_ENABLE_NZ", "3", "weight_nz_mode (from $VLLM_ASCEND_ENABLE_NZ)"),
    ("DYNAMIC_EPLB", "enabled", "eplb_config.dynamic_eplb (from $DYNAMIC_EPLB)"),
])
def test_bad_env_value_names_the_variable(var: str, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse("{}", env={var: text}, engine=EP)
    assert info.value.keys == (key,)


def test_unrelated_environment_is_ignored() -> None:
    config = parse("{}", env={"HCCL_BUFFSIZE": "1024", "VLLM_ASCEND_APPLY_DSV4_PATCH": "1"})
    assert config.warnings == ()


@pytest.mark.parametrize("key", sorted(REMOVED_KEYS))
def test_removed_key_is_ignored_with_a_warning(key: str) -> None:
    samples = {bool: True, int: 2, str: "int8"}
    expected = REMOVED_KEYS[key].expected
    config = parse({key: samples.get(expected, {})})
    assert config.inactive_keys == (key,)
    assert config.warnings == (
        f"{key}: removed from vLLM-Ascend, ignored; {REMOVED_KEYS[key].hint}",)


def test_removed_key_values_are_still_type_checked() -> None:
    with pytest.raises(ConfigError) as info:
        parse({"enable_weight_nz_layout": "yes",
               "torchair_graph_config": {"graph_batch_sizes": ["16"]}})
    assert info.value.keys == ("enable_weight_nz_layout",
                               "torchair_graph_config.graph_batch_sizes[0]")


def test_ascend_only_keys_are_without_effect_everywhere() -> None:
    """Off npu they are inactive; on npu too, since pdmesh's backend implements none of
    vLLM-Ascend's runtime settings - never silently accepted."""
    raw = {"enable_cpu_binding": True, "ascend_compilation_config": {"fuse_muls_add": False},
           "scheduler_config": {"enable_balance_scheduling": True}, "enable_kv_nz": False}
    unbuilt = ("1 key(s) pdmesh does not implement yet; without effect: "
               "scheduler_config.enable_balance_scheduling")
    on_npu = parse(raw, device="npu")
    assert on_npu.inactive_keys == ("ascend_compilation_config", "enable_cpu_binding",
                                    "enable_kv_nz", "scheduler_config.enable_balance_scheduling")
    assert len(on_npu.warnings) == 2 and "npu backend does not implement" in \
        on_npu.warnings[0] and on_npu.warnings[0].endswith(
            "without effect: ascend_compilation_config, enable_cpu_binding, enable_kv_nz")
    assert on_npu.warnings[1] == unbuilt
    on_cpu = parse(raw, device="cpu")
    assert on_cpu.inactive_keys == on_npu.inactive_keys
    assert on_cpu.warnings == ("3 key(s) only act on Ascend NPUs and are inactive on cpu: "
                               "ascend_compilation_config, enable_cpu_binding, enable_kv_nz",
                               unbuilt)
    assert on_cpu == on_npu  # same values; only the report differs


def test_env_fed_ascend_keys_are_inactive_off_npu() -> None:
    config = parse("{}", env={"VLLM_ASCEND_ENABLE_NZ": "0"}, device="cuda")
    assert config.inactive_keys == ("weight_nz_mode",)
