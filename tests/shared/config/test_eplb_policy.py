"""eplb_config.eplb_policy_type reaches the EPLB controller (through the engine's
reports); what it cannot do here is said."""

from __future__ import annotations

import json

import pytest

from pdmesh.shared.config.serve import serve_config


def check(eplb: dict, *words: str):
    return serve_config("config check", [
        "--role", "decode", "--model", "/tmp/m", "--device", "cpu", "-dp", "2",
        "--enable-expert-parallel", "--additional-config",
        json.dumps({"eplb_config": {"dynamic_eplb": True, **eplb}}), *words])


@pytest.mark.parametrize(("eplb", "policy", "said"), [
    ({}, 2, None),  # vLLM-Ascend's default: SwiftBalance
    ({"eplb_policy_type": 1}, 1, None),
    ({"eplb_policy_type": 3}, 3, None),  # FlashLB, on the ranks' load series
    ({"eplb_policy_type": 0}, 0, "without effect: 0 swaps the last experts of ranks 3"),
])
def test_the_policy_goes_to_the_controller_or_is_said(eplb, policy, said):
    cfg = check(eplb)
    assert cfg.engine.eplb_policy_type == policy
    found = [w for w in cfg.warnings if "eplb_policy_type" in w]
    assert (found == []) if said is None else (said in found[0])


def test_upstream_eplb_places_by_deepseek_s_policy():
    cfg = serve_config("config check", [
        "--role", "decode", "--model", "/tmp/m", "--device", "cpu", "-dp", "2",
        "--enable-expert-parallel", "--enable-eplb"],
        env={"VLLM_USE_V2_MODEL_RUNNER": "1"})
    assert cfg.engine.eplb_policy_type is None


def upstream(eplb: dict):
    return serve_config("config check", [
        "--role", "decode", "--model", "/tmp/m", "--device", "cpu", "-dp", "2",
        "--enable-expert-parallel", "--enable-eplb", "--eplb-config", json.dumps(eplb)],
        env={"VLLM_USE_V2_MODEL_RUNNER": "1"})


def test_upstream_eplb_config_is_vllm_s_eplbconfig():
    """Its cadence reaches the engine; its unknown keys and bad values are refused as
    vLLM refuses them; what pdmesh does not act on is said."""
    cfg = upstream({"window_size": 50, "step_interval": 400, "num_redundant_experts": 2})
    e = cfg.engine
    assert (e.eplb_rounds, e.eplb_step_interval, e.expert_load_window) == ("vllm", 400, 50)
    assert not [w for w in cfg.warnings if "eplb" in w]
    said = upstream({"log_balancedness": True, "use_async": False}).warnings
    assert any("--eplb-config.log_balancedness: without effect" in w for w in said)
    assert any("--eplb-config.use_async: without effect" in w for w in said)
    for bad, words in [({"bogus": 1}, "--eplb-config.bogus: not a vLLM EPLB field"),
                       ({"step_interval": 0}, "--eplb-config.step_interval: must be >= 1"),
                       ({"window_size": True}, "window_size: must be an integer"),
                       ({"policy": "flash"}, "policy: must be one of default"),
                       ({"communicator": "pynccl"}, "incompatible with async EPLB")]:
        with pytest.raises(ValueError) as e:
            upstream(bad)
        assert words in str(e.value), (bad, str(e.value))


def test_vllm_ascend_dynamic_eplb_runs_in_rounds():
    e = check({"expert_heat_collection_interval": 64, "algorithm_execution_interval": 9}).engine
    assert (e.eplb_rounds, e.expert_load_window, e.eplb_algorithm_steps) == (
        "vllm-ascend", 64, 9)
    assert check({}).engine.eplb_algorithm_steps == 50  # its default
