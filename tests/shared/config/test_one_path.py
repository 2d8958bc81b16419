"""One config path: the services, `pdmesh config check` and `pdmesh up` read flags with
the same parser and the same flags -> ServeConfig function, so the seeds' `vllm serve`
lines start as they are and `config check` says exactly what a service would do."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdmesh.shared.config.command_line import FlagError, parse_command_line
from pdmesh.shared.config.serve import engine_role, read_config, serve_config
from pdmesh.shared.config.vllm_cli import _expand, _shell_words
from tests.shared.config.vllm_command_lines import SEED_COMMANDS

GOOD_SEEDS = [c for c in SEED_COMMANDS if c.error is None]


def seed_words(case) -> list[str]:
    """The words after `vllm serve`, variables expanded, shell text after it dropped."""
    words = _shell_words(case.command)
    while words[0] != "vllm":
        words.pop(0)
    words = words[2:]
    cut = next((i for i, w in enumerate(words) if w in ("2>&1", "|")), len(words))
    words, problems = _expand(words[:cut], case.variables)
    assert problems == []
    return words


@pytest.mark.parametrize("case", GOOD_SEEDS, ids=lambda c: c.name)
def test_every_seed_line_is_read_by_the_service_parser_as_it_is(case):
    check = parse_command_line("config check", seed_words(case))
    role = engine_role(check)
    flags = parse_command_line(role, seed_words(case))  # what `pdmesh ROLE ...` reads
    config = read_config(flags, device="cpu")
    assert config.role == role
    for name, want in case.expect.items():
        assert getattr(config, name) == want, name
    if "--max_model_len" in case.command:  # vLLM's underscore spelling is read too
        assert flags.max_model_len is not None and "--max-model-len" in flags.given


def test_a_seed_line_starts_a_service_exactly_as_config_check_says():
    """The DeepSeek-V4 PD decode line: the parser takes every flag, and `config check`
    resolves it to the engine the service would run (tensor parallelism 16 beside DP
    and MTP drafting)."""
    case = next(c for c in SEED_COMMANDS if c.name == "dsv4_pd_decode")
    words = seed_words(case)
    by_check = serve_config("config check", words)
    config = serve_config("decode", [*words, "--kvstore", "127.0.0.1:1"])
    assert by_check.engine == config.engine
    assert config.engine.tensor_parallel_size == 16
    assert config.engine.max_model_len == 131072 and config.engine.block_size == 128
    assert "--no-disable-hybrid-kv-cache-manager" in config.accepted_without_effect
    # MTP drafting is configured
    assert "--speculative-config" not in config.accepted_without_effect
    assert config.engine.speculative_config.is_mtp


@pytest.mark.parametrize("case", GOOD_SEEDS, ids=lambda c: c.name)
def test_every_seed_line_runs_on_cpu_or_names_the_one_flag_it_cannot(case, qwen3_path):
    """Each seed line, its model swapped for the tiny one, either builds an engine on cpu
    that generates (the flags beyond cpu listed as without effect), or is refused with one
    line naming a flag of that line and why."""
    from pdmesh.shared.engine import SamplingParams
    from pdmesh.shared.engine.build import build_engine

    words = [str(qwen3_path), *seed_words(case)[1:]]
    role = engine_role(parse_command_line("config check", words))
    try:
        check = serve_config("config check", ["--role", role, *words, "--device", "cpu"])
    except ValueError as e:
        check = e
    try:
        config = serve_config(role, [*words, "--device", "cpu"])
    except ValueError as e:
        flag, _, why = str(e).partition(": ")
        # (the flag in its canonical spelling; the line may write vLLM's underscores)
        assert flag.startswith("--") and why and "\n" not in why
        assert flag in case.command.replace("_", "-")
        assert str(check) == str(e)  # config check refuses it with the same words
        return
    # config check's verdict is the instance's: the same engine, the same said
    assert not isinstance(check, Exception), check
    assert check.engine == config.engine
    assert check.accepted_without_effect == config.accepted_without_effect
    assert (check.flag_warnings, check.warnings) == (config.flag_warnings, config.warnings)
    engine = build_engine(config.engine)
    request = engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4,
                                                              ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(request.output_token_ids) == 4


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdmesh", *args], capture_output=True,
                          text=True, timeout=120)


BAD = [
    ["--max_model_len", "abc"],
    ["--additional-config", '{"scheduler_config": {"dyntra_lb_config": {"enabled": true}}}'],
    ["--tensor-parallel-size", "0"],
    ["--enable-priority-scheduling", "--scheduling-policy", "priority"],
    ["--max-num-seq", "8"],
]


@pytest.mark.parametrize("flags", BAD, ids=lambda f: f[0])
def test_config_check_refuses_what_the_service_refuses_with_the_same_words(qwen3_path,
                                                                           flags):
    check = run("config", "check", "--role", "decode", *flags)
    service = run("decode", str(qwen3_path), "--kvstore", "127.0.0.1:1", "--device", "cpu",
                  *flags)
    assert check.returncode == service.returncode == 2
    errors = [ln for ln in check.stderr.splitlines() if ln.startswith("pdmesh: error: ")]
    assert errors and all(e in service.stderr for e in errors), (check.stderr,
                                                                 service.stderr)


def test_what_config_check_accepts_the_service_runs(qwen3_path):
    """Accepted by config check -> the service gets past its flags (here as far as the
    unreachable kvstore), and both list the same flags as without effect."""
    flags = ["--max_model_len", "512", "--speculative-config", '{"method": "eagle"}',
             "--no-disable-hybrid-kv-cache-manager", "--tp-size", "1"]
    check = run("config", "check", "--role", "decode", *flags)
    assert check.returncode == 0, check.stderr
    service = run("decode", str(qwen3_path), "--kvstore", "127.0.0.1:1", "--device", "cpu",
                  *flags)
    assert service.returncode == 2 and "no kvstore answers at 127.0.0.1:1" in service.stderr
    for flag in ("--speculative-config", "--no-disable-hybrid-kv-cache-manager"):
        assert flag in check.stderr and flag in service.stderr


def test_up_checks_its_engines_flags_before_starting_anything(qwen3_path, tmp_path):
    r = run("up", str(qwen3_path), "--engine-args", "--max-model-len x --bogus",
            "--log-dir", str(tmp_path))
    assert r.returncode == 2
    assert "--max-model-len: expected an int, got 'x'" in r.stderr and "--bogus" in r.stderr
    assert list(tmp_path.iterdir()) == []  # no service started, no log written


def test_every_problem_of_a_command_line_at_once():
    with pytest.raises(FlagError) as e:
        parse_command_line("prefill", ["m", "--max-model-len", "x", "--bogus", "--port"])
    assert len(e.value.problems) == 3


def test_launcher_args_split_as_a_shell_would(qwen3_path, tmp_path):
    """--engine-args carries a JSON flag with spaces in quotes as one word; an unclosed
    quote is refused naming the flag."""
    from pdmesh.cli import parse_args
    from pdmesh.shared.cli.up import plan

    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    cfg = parse_args(["up", str(qwen3_path), "--log-dir", str(tmp_path), "--engine-args",
                      f"--speculative-config '{spec}' --max-num-seqs 4"])[2]
    words = plan(cfg).engine_words["decode"]
    assert words[words.index("--speculative-config") + 1] == spec
    assert words[-2:] == ["--max-num-seqs", "4"]
    bad = parse_args(["up", str(qwen3_path), "--log-dir", str(tmp_path), "--decode-args",
                      "--seed '1"])[2]
    with pytest.raises(ValueError, match="^--decode-args: "):
        plan(bad)


def test_mtp_lines_carry_the_verify_settings_to_the_engine():
    """An MTP line with vLLM-Ascend's rejection_sampler_config and dynamic_spec_config
    (dflash): both reach the engine's speculative config, neither is listed inactive;
    with n-gram drafts (no draft logits to take a confidence from) the line is refused
    as vLLM-Ascend refuses a dynamic method that is not the speculative one."""
    extra = ('{"rejection_sampler_config": {"enable_entropy_verify": true}, '
             '"dynamic_spec_config": {"method": "dflash", "method_params": '
             '{"initial_verify_budget_per_req": 2, "budget_update_interval": 50, '
             '"budget_threshold": 0.7}}}')
    config = serve_config("mixed", ["/models/x", "--device", "cpu", "--speculative-config",
                                    '{"method": "deepseek_mtp", "num_speculative_tokens": 3}',
                                    "--additional-config", extra])
    spec = config.engine.speculative_config
    assert spec.is_mtp and spec.num_speculative_tokens == 3 and spec.enable_entropy_verify
    assert (spec.dynamic.initial_verify_budget_per_req, spec.dynamic.budget_update_interval,
            spec.dynamic.budget_threshold) == (2, 50, 0.7)
    assert not set(config.additional_config.inactive_keys) & {"rejection_sampler_config",
                                                               "dynamic_spec_config"}
    ngram = '{"method": "ngram", "num_speculative_tokens": 2}'
    with pytest.raises(ValueError, match='dynamic_spec_config.method: needs '
                                         '--speculative-config with method "dflash"'):
        serve_config("mixed", ["/models/x", "--device", "cpu", "--speculative-config", ngram,
                               "--additional-config", extra])
