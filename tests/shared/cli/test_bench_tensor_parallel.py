"""`pdmesh bench tensor-parallel` runs TP1 and TP2 side by side and reports their speed,
rank 0's weights and where a TP2 decode step's time goes."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_tensor_parallel_reports_both_sizes_and_the_step_split(qwen3_path, tmp_path):
    out = tmp_path / "tp.json"
    r = subprocess.run([sys.executable, "-m", "pdmesh", "bench", "tensor-parallel", "--model",
                        str(qwen3_path), "--batch", "4", "--input-len", "16", "--output-len",
                        "4", "--single-output-len", "6", "--runs", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    one, two = got["rows"]
    assert (one["tp"], two["tp"]) == (1, 2)
    assert two["same_outputs"] is True
    assert 0.4 * one["rank0_weight_mb"] < two["rank0_weight_mb"] < 0.6 * one["rank0_weight_mb"]
    split = got["decode_step_split"]
    assert set(split) == {"broadcast", "all_reduce", "gather_logits", "compute_and_rest"}
    assert all(v > 0 for k, v in split.items() if k != "compute_and_rest")
    assert abs(sum(split.values()) - 1.0) < 1e-9
    assert "TP2 decode step" in r.stdout
