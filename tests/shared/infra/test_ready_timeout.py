"""How long started services get to be ready: from the environment, as vLLM's
VLLM_ENGINE_READY_TIMEOUT_S, not hard-coded."""

from __future__ import annotations

import sys

import pytest

from pdmesh.shared.infra import launcher
from pdmesh.shared.infra.launcher import READY_TIMEOUT_S, Service, ready_timeout_s


def test_default_and_both_variables(monkeypatch):
    monkeypatch.delenv("PDMESH_READY_TIMEOUT_S", raising=False)
    monkeypatch.delenv("VLLM_ENGINE_READY_TIMEOUT_S", raising=False)
    assert ready_timeout_s() == READY_TIMEOUT_S == 600.0
    monkeypatch.setenv("VLLM_ENGINE_READY_TIMEOUT_S", "1800")
    assert ready_timeout_s() == 1800.0
    monkeypatch.setenv("PDMESH_READY_TIMEOUT_S", "45.5")  # ours first
    assert ready_timeout_s() == 45.5


@pytest.mark.parametrize("raw", ["soon", "0", "-3", "inf", "nan"])
def test_a_bad_value_names_the_variable(monkeypatch, raw):
    monkeypatch.delenv("PDMESH_READY_TIMEOUT_S", raising=False)
    monkeypatch.setenv("VLLM_ENGINE_READY_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match="VLLM_ENGINE_READY_TIMEOUT_S"):
        ready_timeout_s()


def test_a_service_that_never_says_ready_is_stopped_after_the_timeout(
        monkeypatch, tmp_path):
    """A child that runs but never prints its ready line: stopped once the environment's
    timeout has passed, and the error says which limit it hit."""
    monkeypatch.setenv("PDMESH_READY_TIMEOUT_S", "2")
    # `python -m pdmesh` replaced by a child that sleeps: the launcher's own spawn path
    svc = Service.__new__(Service)
    svc.role, svc.echo, svc.args, svc.env, svc.log_dir, svc.starts = (
        "sleeper", None, [], {}, tmp_path, 0)
    monkeypatch.setattr(launcher.subprocess, "Popen", _popen_sleeper(launcher.subprocess.Popen))
    svc._spawn()
    with pytest.raises(RuntimeError, match=r"not within 2 s \(PDMESH_READY_TIMEOUT_S\)"):
        svc.wait_ready()
    assert svc.proc.poll() is not None  # stopped, not left running


def _popen_sleeper(popen):
    def start(cmd, **kw):
        return popen([sys.executable, "-c", "import time; print('loading', flush=True); "
                      "time.sleep(60)"], **kw)
    return start


def test_an_engine_without_a_kvstore_waits_the_ready_timeout_then_names_the_flag(
        qwen3_path, registry_prefix):
    """No --kvstore and none in the registry: the prefill instance waits for one (saying
    so) for the ready timeout, then stops with one message naming --kvstore."""
    import os
    import subprocess

    env = {**os.environ, "PDMESH_READY_TIMEOUT_S": "2"}
    r = subprocess.run([sys.executable, "-m", "pdmesh", "prefill", str(qwen3_path),
                        "--device", "cpu", "--host", "127.0.0.1", "--port", "0",
                        "--registry-prefix", registry_prefix + "-nokv"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "waiting up to 2 s" in r.stderr
    assert "pdmesh: error: --kvstore: no kvstore answers in the registry" in r.stderr
