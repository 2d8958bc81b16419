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
