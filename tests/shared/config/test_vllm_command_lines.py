"""``parse_vllm_serve`` on every seed command line, and ``pdmesh config check --vllm-command``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdmesh.shared.config import ConfigError
from pdmesh.shared.config.vllm_cli import FLAGS, VllmCommandError, parse_vllm_serve
from tests.shared.config.vllm_command_lines import SEED_COMMANDS, SeedCommand


@pytest.mark.parametrize("case", SEED_COMMANDS, ids=lambda c: c.name)
def test_seed_command_line(case: SeedCommand):
    if case.error is not None:
        with pytest.raises(ValueError) as info:
            parse_vllm_serve(case.command, variables=case.variables)
        assert case.error in str(info.value)
        return
    config = parse_vllm_serve(case.command, variables=case.variables)
    for name, want in case.expect.items():
        assert getattr(config, name) == want, name


def test_seed_placeholder_is_rejected_naming_the_key():
    case = next(c for c in SEED_COMMANDS if c.name == "ac_placeholder")
    with pytest.raises(ConfigError) as info:
        parse_vllm_serve(case.command)
    assert info.value.keys == ("config_key",)


def test_seed_typo_names_the_three_dash_flag():
    case = next(c for c in SEED_COMMANDS if c.name == "features_chunked_prefill_typo")
    with pytest.raises(VllmCommandError) as info:
        parse_vllm_serve(case.command)
    assert info.value.problems[0].startswith("---max-num-batched-tokens: ")


def test_pd_seed_commands_pass_kv_role_and_parallelism_through():
    by_name = {c.name: c for c in SEED_COMMANDS}
    decode = parse_vllm_serve(by_name["dsv4_pd_decode"].command,
                              variables=by_name["dsv4_pd_decode"].variables)
    assert decode.kv_transfer_config["kv_role"] == "kv_consumer"
    assert decode.additional_config.scheduler_config.recompute_scheduler_enable is True
    prefill = parse_vllm_serve(by_name["dsv4_pd_prefill"].command,
                               variables=by_name["dsv4_pd_prefill"].variables)
    assert prefill.kv_transfer_config["kv_role"] == "kv_producer"
    assert prefill.speculative_config["method"] == "mtp"


def test_every_seed_flag_is_known():
    """The seed commands use no flag missing from the table (the typo aside)."""
    for case in SEED_COMMANDS:
        if case.error is None:
            parse_vllm_serve(case.command, variables=case.variables)
    assert "--headless" in FLAGS and "--max-model-len" in FLAGS


def test_unknown_flag_suggests_the_closest():
    with pytest.raises(VllmCommandError, match=r"--max-num-seq: .*did you mean --max-num-seqs"):
        parse_vllm_serve("vllm serve m --max-num-seq 4")


def test_wrong_type_names_the_flag():
    with pytest.raises(VllmCommandError, match=r"--max-model-len: expected an int, got 'abc'"):
        parse_vllm_serve("vllm serve m --max-model-len abc")
    with pytest.raises(VllmCommandError, match="--kv-transfer-config"):
        parse_vllm_serve("vllm serve m --kv-transfer-config '[1]'")
    with pytest.raises(VllmCommandError, match="--enforce-eager: takes no value"):
        parse_vllm_serve("vllm serve m --enforce-eager=yes")


def test_every_problem_is_listed():
    with pytest.raises(VllmCommandError) as info:
        parse_vllm_serve("vllm serve m --max-model-len x --bogus --port")
    assert len(info.value.problems) == 3


def test_equals_form_underscores_and_aliases():
    c = parse_vllm_serve("vllm serve m --max_model_len=4096 -tp 2 --dtype=bfloat16 "
                         "--served-model-name a b --no-enable-prefix-caching")
    assert (c.max_model_len, c.tensor_parallel_size, c.dtype) == (4096, 2, "bfloat16")
    assert c.served_model_name == ("a", "b") and c.enable_prefix_caching is False


def test_env_prefix_feeds_the_additional_config():
    c = parse_vllm_serve("DYNAMIC_EPLB=1 vllm serve m --enable-expert-parallel")
    assert c.env == {"DYNAMIC_EPLB": "1"}
    assert c.additional_config.eplb_config.dynamic_eplb is True


def test_comments_continuations_and_pipes():
    c = parse_vllm_serve("vllm serve m \\\n  --port 9000 \\\n  --seed 3 # the seed \\\n"
                         "  --max-model-len abc")
    assert (c.port, c.seed, c.max_model_len) == (9000, 3, None)
    c = parse_vllm_serve("vllm serve m --port 9000 2>&1 | tee log")
    assert c.port == 9000 and any("2>&1 | tee log" in w for w in c.warnings)


def test_shell_variables_need_values():
    with pytest.raises(VllmCommandError, match=r"--port: '\$2' is an unexpanded shell"):
        parse_vllm_serve("vllm serve m --port $2")
    assert parse_vllm_serve("vllm serve m --port ${P}", variables={"P": "1"}).port == 1


def test_not_a_vllm_serve_command():
    with pytest.raises(VllmCommandError, match="vllm serve"):
        parse_vllm_serve("python -m sglang.launch_server --model-path m")
    with pytest.raises(VllmCommandError, match="model"):
        parse_vllm_serve("vllm serve --port 1")


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdmesh", "config", "check", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_prints_the_effective_config():
    r = check("--vllm-command", "vllm serve m --max-model-len 4096 --quantization ascend "
                                "--additional-config '{\"enable_weight_nz_layout\": true}'")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["model"] == "m" and out["max_model_len"] == 4096
    assert "weight_nz_mode" in out["additional_config"]
    assert out["quantization"] == "ascend"  # (it takes effect: not listed)
    assert "--quantization" not in r.stderr and "enable_weight_nz_layout" in r.stderr


def test_cli_names_bad_flags():
    r = check("--vllm-command", "vllm serve m ---max-num-batched-tokens 2048")
    assert r.returncode == 2 and r.stdout == ""
    assert "did you mean --max-num-batched-tokens" in r.stderr
    r = check("--vllm-command", "vllm serve m --additional-config '{\"config_key\": 1}'")
    assert r.returncode == 2 and "config_key" in r.stderr
