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


def test_checks_a_line_for_a_device_this_machine_lacks():
    """--device npu checks what an Ascend instance would run (this machine has no NPU):
    the Ascend-only keys are listed as without effect there too, by name."""
    ascend = ('{"enable_cpu_binding": true, "multistream_overlap_shared_expert": false, '
              '"ascend_compilation_config": {"enable_npugraph_ex": true}}')
    r = check("--device", "npu", "--role", "decode", "--additional-config", ascend)
    assert r.returncode == 0, r.stderr
    inactive = next(line for line in r.stderr.splitlines() if line.startswith("inactive on"))
    assert inactive.startswith("inactive on npu: ")
    assert set(inactive.split(": ", 1)[1].split(", ")) == {
        "ascend_compilation_config", "enable_cpu_binding", "multistream_overlap_shared_expert"}
    assert "npu backend does not implement" in r.stderr
    r = check("--device", "tpu")
    assert r.returncode == 2 and "--device" in r.stderr


def test_speculative_config_takes_effect_for_ngram_and_mtp_and_is_listed_otherwise():
    r = check("--role", "mixed", "--speculative-config",
              '{"method": "ngram", "num_speculative_tokens": 3}')
    assert r.returncode == 0 and "--speculative-config" not in r.stderr, r.stderr
    r = check("--role", "decode", "--speculative-config",
              '{"method": "deepseek_mtp", "num_speculative_tokens": 1}')
    assert r.returncode == 0 and "--speculative-config" not in r.stderr, r.stderr
    r = check("--role", "decode", "--speculative-config",
              '{"method": "eagle", "num_speculative_tokens": 1}')
    assert r.returncode == 0
    assert "accepted without effect: --speculative-config" in r.stderr
    assert "method 'eagle' is not run yet" in r.stderr
    for bad, names in (('{"method": "ngram", "num_speculative_tokens": 99}',
                        "num_speculative_tokens"), ("[1]", "must be a JSON object")):
        r = check("--role", "mixed", "--speculative-config", bad)
        assert r.returncode == 2 and "--speculative-config" in r.stderr and names in r.stderr


def test_rejection_sampler_config_acts_once_ngram_drafts_run():
    rs = ('{"rejection_sampler_config": {"enable_block_verify": true, '
          '"enable_entropy_verify": true, "posterior_threshold": 0.9}}')
    r = check("--role", "mixed", "--additional-config", rs)
    assert r.returncode == 0 and "rejection_sampler_config" in r.stderr.split(
        "inactive on")[1]
    r = check("--role", "mixed", "--additional-config", rs, "--speculative-config",
              '{"method": "ngram", "num_speculative_tokens": 3}')
    assert r.returncode == 0 and "rejection_sampler_config" not in r.stderr, r.stderr
    from pdmesh.cli import parse_args

    spec = parse_args(["config", "check", "--role", "mixed", "--model", "/m", "--device",
                       "cpu", "--additional-config", rs, "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 3}'])[2] \
        .engine.speculative_config
    assert (spec.enable_block_verify, spec.enable_entropy_verify, spec.posterior_threshold,
            spec.posterior_alpha) == (True, True, 0.9, 0.4)
