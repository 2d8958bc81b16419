"""Service start-up checks every serving flag before loading anything."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdmesh.shared.config.serve import serve_config


def start(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdmesh", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize(("args", "needle"), [
    (["prefill", "--additional-config", '{"bogus_key": 1}'], "bogus_key"),
    (["decode", "--additional-config",
      '{"scheduler_config": {"dyntra_lb_config": {"enabled": true}}}'], "data_parallel_size"),
    (["decode", "--kv-transfer-config", '{"kv_role": "kv_producer"}'], "kv_role"),
    (["prefill", "--kv-transfer-config", "{not json"], "--kv-transfer-config"),
    (["prefill", "--tensor-parallel-size", "0"], "tensor_parallel_size: must be >= 1"),
    (["prefill", "--tensor-parallel-size", "3"],
     "--tensor-parallel-size: 3 does not divide num_attention_heads"),
    (["decode", "--data-parallel-size", "0"], "--data-parallel-size"),
    # two ranks start; the first to fail (no kvstore there) ends start-up with its error
    (["decode", "--data-parallel-size", "2"], "rank"),
])
def test_bad_flags_stop_startup_with_a_named_error(qwen3_path, args, needle):
    r = start(*args, "--model", str(qwen3_path), "--kvstore", "127.0.0.1:1", "--device", "cpu")
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr


def test_vllm_flags_without_effect_are_accepted(qwen3_path):
    """A vLLM-Ascend command line's extra flags pass the parser: start-up gets as far as
    the (unreachable) kvstore, and says which flags had no effect."""
    r = start("prefill", "--model", str(qwen3_path), "--kvstore", "127.0.0.1:1",
              "--device", "cpu", "--pipeline-parallel-size", "1", "--trust-remote-code",
              "--speculative-config", '{"method": "mtp"}', "--async-scheduling")
    assert r.returncode == 2, r.stderr
    assert "kvstore" in r.stderr and "unrecognized" not in r.stderr
    assert "--pipeline-parallel-size" in r.stderr and "--trust-remote-code" in r.stderr


def test_sglang_max_total_tokens_sizes_the_kv_cache(tmp_path):
    c = serve_config("serve", [str(tmp_path), "--max-total-tokens", "1000", "--block-size",
                               "16"], env={}, device="cpu")
    assert c.engine.num_kv_blocks == 64  # 63 blocks of 16 tokens, and the null block
    both = serve_config("serve", [str(tmp_path), "--max-total-tokens", "1000",
                                  "--num-kv-blocks", "9"], env={}, device="cpu")
    assert both.engine.num_kv_blocks == 9
    with pytest.raises(ValueError, match="--max-total-tokens"):
        serve_config("serve", [str(tmp_path), "--max-total-tokens", "0"], env={},
                     device="cpu")
