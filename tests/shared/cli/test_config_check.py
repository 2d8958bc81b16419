"""`pdmesh config check` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdmesh", "config", "check", *args],
                          capture_output=True, text=True, timeout=60)


def test_effective_config_on_success():
    r = check("--additional-config",
              '{"scheduler_config": {"dyntra_lb_config": {"enabled": true, "start_step": 10}}}',
              "--kv-transfer-config", '{"kv_role": "kv_consumer"}', "--data-parallel-size", "2")
    assert r.returncode == 0, r.stderr
    lb = json.loads(r.stdout)["scheduler_config"]["dyntra_lb_config"]
    assert lb["enabled"] is True and lb["start_step"] == 10 and lb["bubble_threshold"] == 5.0


def test_every_problem_named_on_failure():
    r = check("--additional-config",
              '{"scheduler_config": {"dyntra_lb_config": {"enabled": true, "bubble_treshold": 3}}}')
    assert r.returncode == 2 and r.stdout == ""
    assert "bubble_treshold" in r.stderr and "did you mean" in r.stderr
    assert "kv_consumer" in r.stderr and "data_parallel_size" in r.stderr


def test_bad_json_names_the_flag():
    r = check("--additional-config", '{"enable_cpu_binding": tru}')
    assert r.returncode == 2 and "additional" in r.stderr.lower()
    r = check("--kv-transfer-config", "[1]")
    assert r.returncode == 2 and "--kv-transfer-config" in r.stderr


def test_short_request_first_with_sglang_priority_scheduling_is_refused():
    srf = '{"scheduler_config": {"short_request_first_config": {"enabled": true}}}'
    assert check("--additional-config", srf).returncode == 0
    r = check("--additional-config", srf, "--enable-priority-scheduling")
    assert r.returncode == 2
    assert "short_request_first_config.enabled" in r.stderr
    assert "--enable-priority-scheduling" in r.stderr
