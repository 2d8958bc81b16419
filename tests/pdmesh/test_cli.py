"""The command line's shape: every command that takes --model takes it positionally too."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdmesh.cli import parse_args


def parsed(argv: list[str]):
    return parse_args(argv, resolve=False)[2]


@pytest.mark.parametrize("command", [["prefill"], ["decode"], ["mixed"], ["gateway"],
                                     ["generate"], ["serve"], ["up"]])
def test_model_positional_or_flag(command):
    assert parsed([*command, "/models/a"]).model == "/models/a"
    assert parsed([*command, "--model", "/models/a"]).model == "/models/a"
    assert parsed([*command, "/models/a", "--model", "/models/a"]).model == "/models/a"


def test_model_given_twice_differently_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        parsed(["decode", "/models/a", "--model", "/models/b"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "model: given twice" in err and "/models/a" in err and "/models/b" in err


@pytest.mark.parametrize("command", [["prefill"], ["gateway"], ["bench", "serve"]])
def test_model_missing_is_an_error(command, capsys):
    with pytest.raises(SystemExit) as e:
        parsed(command)
    assert e.value.code == 2 and "model: required" in capsys.readouterr().err


def test_up_defaults_to_the_demo_model():
    assert parsed(["up"]).model is None


def test_version_is_the_installed_package_version():
    """`pdmesh --version`, as `vllm --version`: the distribution's version, nothing else."""
    import subprocess
    import sys
    from importlib.metadata import version

    run = subprocess.run([sys.executable, "-m", "pdmesh", "--version"], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and run.stdout == version("pdmesh") + "\n", run.stderr


@pytest.mark.parametrize(("flags", "needle"), [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice: needs --tool-call-parser"),
    (["--tool-call-parser", "bogus"], "--tool-call-parser: must be one of"),
    (["--reasoning-parser", "bogus"], "--reasoning-parser: must be one of"),
    (["--tokenizer-mode", "mistral"], "--tokenizer-mode: must be one of"),
])
def test_the_gateway_refuses_parsers_it_does_not_have(qwen3_path, flags, needle):
    r = subprocess.run([sys.executable, "-m", "pdmesh", "gateway", str(qwen3_path), "--port",
                        "0", *flags], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and needle in r.stderr, r.stderr
