"""--kv-transfer-config as the seeds write it: Mooncake connectors accepted, others
refused naming the field, vLLM's placement fields listed as without effect, the extra
config's sizes checked against the instance's own flags."""

from __future__ import annotations

import json

import pytest

from pdmesh.shared.config.serve import serve_config

SEED_PREFILL = {"kv_connector": "MooncakeHybridConnector", "kv_role": "kv_producer",
                "kv_port": "30000", "engine_id": "0",
                "kv_connector_extra_config": {"prefill": {"dp_size": 2, "tp_size": 16},
                                              "decode": {"dp_size": 16, "tp_size": 2}}}


def config(role: str, kv: dict, *extra: str):
    return serve_config(role, ["/m", "--kvstore", "127.0.0.1:1", "--kv-transfer-config",
                               json.dumps(kv), *extra], device="cpu")


def test_the_seed_line_is_read_and_what_it_cannot_do_is_said():
    cfg = config("prefill", SEED_PREFILL)
    warned = " | ".join(cfg.flag_warnings)
    assert "without effect (pdmesh's Mooncake pool and registry place the KV): kv_port, " \
           "engine_id" in warned
    # the seed's prefill side is DP2 x TP16; this instance runs DP1 x TP1: told, not refused
    assert "kv_connector_extra_config.prefill.dp_size is 2 but this prefill instance runs 1" \
        in warned
    assert "tp_size is 16" in warned
    same = config("prefill", {**SEED_PREFILL, "kv_connector_extra_config": {
        "prefill": {"dp_size": 1, "tp_size": 1}}})
    assert not any("but this prefill instance" in w for w in same.flag_warnings)


@pytest.mark.parametrize(("kv", "message"), [
    ({"kv_connector": "NixlConnector"}, "kv_connector 'NixlConnector' is not supported"),
    ({"kv_connector": "MooncakeConectorV1"}, "did you mean MooncakeConnectorV1?"),
    ({"kv_conector": "MooncakeConnectorV1"}, "unknown field 'kv_conector'; did you mean "
                                             "kv_connector?"),
    ({"kv_connector_extra_config": {"decode": {"tp_size": 0}}},
     "kv_connector_extra_config.decode.tp_size must be a whole number >= 1, got 0"),
    ({"kv_connector_extra_config": {"decode": {"dp_size": "2"}}}, "decode.dp_size"),
    ({"kv_connector_extra_config": []}, "kv_connector_extra_config must be an object"),
    ({"kv_load_failure_policy": "retry"}, "kv_load_failure_policy must be recompute or fail, "
                                          "got 'retry'"),
    ({"kv_connector_extra_config": {"load_async": "yes"}},
     "kv_connector_extra_config.load_async must be true or false, got 'yes'"),
])
def test_what_pdmesh_cannot_run_is_refused_naming_the_field(kv, message):
    with pytest.raises(ValueError, match="--kv-transfer-config: ") as info:
        config("decode", {"kv_role": "kv_consumer", **kv})
    assert message in str(info.value)


def test_keys_pdmesh_does_not_act_on_are_listed_on_every_device():
    from pdmesh.shared.config import parse_additional_config

    for device in ("cpu", "npu"):
        cfg = parse_additional_config({"mix_placement": True, "rejection_sampler_config": {
            "enable_block_verify": True}}, device=device)
        assert cfg.inactive_keys == ("mix_placement", "rejection_sampler_config")
        assert cfg.warnings == ("2 key(s) pdmesh does not implement yet; without effect: "
                                "mix_placement, rejection_sampler_config",)


def test_the_pool_keys_that_take_effect_reach_the_engine():
    """vLLM's kv_load_failure_policy, vLLM-Ascend's load_async and (a decode instance's)
    consumer_is_to_put take effect (the engine fields the scheduler and the puts read);
    the Ascend Store's keys pdmesh does not act on are told."""
    from pdmesh.shared.config.engine_config import serving_engine_config

    default = serving_engine_config(config("decode", {"kv_role": "kv_consumer"}))
    assert (default.kv_load_failure_policy, default.kv_load_async,
            default.kv_put_finished) == ("recompute", True, False)
    extra = {"load_async": False, "consumer_is_to_put": True, "consumer_is_to_load": True}
    cfg = config("decode", {"kv_role": "kv_consumer", "kv_load_failure_policy": "fail",
                            "kv_connector_extra_config": extra})
    engine = serving_engine_config(cfg)
    assert (engine.kv_load_failure_policy, engine.kv_load_async,
            engine.kv_put_finished) == ("fail", False, True)
    warned = " | ".join(cfg.flag_warnings)
    assert "kv_connector_extra_config.consumer_is_to_load: without effect" in warned
    for acting in ("kv_load_failure_policy", "load_async", "consumer_is_to_put"):
        assert acting not in warned
    prefill = config("prefill", {"kv_role": "kv_producer", "kv_connector_extra_config": extra})
    assert not serving_engine_config(prefill).kv_put_finished
    assert "consumer_is_to_put: without effect on a prefill instance" in " | ".join(
        prefill.flag_warnings)
