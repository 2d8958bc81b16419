"""`pdmesh bench kv-transfer`: two real engines and a real mooncake_master on loopback;
what the prefill engine puts, the decode engine gets and continues from exactly."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3", "deepseek_v4"])
def test_kv_transfer_bench_moves_every_cache_group(tiny_models, arch):
    tokens, bs = 300, 16
    r = subprocess.run([sys.executable, "-m", "pdmesh", "bench", "kv-transfer", "--model",
                        str(tiny_models[arch]), "--tokens", str(tokens), "--block-size", str(bs),
                        "--runs", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    per_token = int(re.search(r"KV bytes per token of history ([\d,]+)", r.stdout)[1]
                    .replace(",", ""))
    put = int(re.search(r"put ([\d,]+) bytes", r.stdout)[1].replace(",", ""))
    get = int(re.search(r"get ([\d,]+) bytes", r.stdout)[1].replace(",", ""))
    assert "decode's next token equals prefill's in 1/1 runs" in r.stdout
    assert put == get > 0
    history = -(-tokens // bs) * bs * per_token
    if arch == "deepseek_v4":  # the history, and the window group's last blocks on top
        assert "cache groups compressed, window" in r.stdout  # (exact bounds: the PD test)
        assert put > history
    else:  # every block of the one group, partial last block included
        assert put == history
