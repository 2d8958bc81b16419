"""The KV tiers in the PD mesh, over HTTP: a prefill instance with a 16-block cache, a host
tier and the file store under it. A prompt pushed out of its blocks by others comes back
from host memory, with the same answer; /metrics and `pdmesh status` count it."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
import torch

from tests.mesh import MODEL, pd_mesh
from tests.services.test_metrics_e2e import scrape

_g = torch.Generator().manual_seed(451)
A = torch.randint(10, 4000, (70,), generator=_g).tolist()
OTHERS = [torch.randint(10, 4000, (70,), generator=_g).tolist() for _ in range(4)]
TIERS = ["--num-kv-blocks", "16", "--enable-hierarchical-cache", "--hicache-size", "0.05",
         "--hicache-storage-backend", "file"]


@pytest.fixture(scope="module")
def mesh(qwen3_path, tmp_path_factory, registry_prefix):
    store = tmp_path_factory.mktemp("hicache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(store))
        with pd_mesh(qwen3_path, tmp_path_factory.mktemp("tiers-pd"),
                     f"{registry_prefix}-tiers", prefill_args=TIERS,
                     gateway_args=["--enable-prompt-tokens-details"]) as services:
            yield {**services, "store": store, "prefix": f"{registry_prefix}-tiers"}


def complete(url: str, prompt: list[int]) -> dict:
    r = httpx.post(url + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prompt_evicted_from_prefill_comes_back_from_the_host_tier(mesh):
    url = mesh["gateway"].info["http"]
    first = complete(url, A)
    for p in OTHERS:  # 4 x 5 blocks: A's leave the prefill instance's 16
        complete(url, p)
    before = scrape(mesh["prefill"].info["metrics"])
    again = complete(url, A)
    after = scrape(mesh["prefill"].info["metrics"])
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    # its 4 full blocks (70 tokens: the last is computed) read back from host memory
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    def host_hits(scraped: dict[str, float]) -> float:
        return sum(v for k, v in scraped.items()
                   if k.startswith("pdmesh_kv_tier_hits_total{") and 'tier="host"' in k)

    assert host_hits(after) - host_hits(before) == 4
    assert after["__pdmesh_kv_tier_bytes_total"] > before["__pdmesh_kv_tier_bytes_total"]
    # every block the prefill instance took went to the file store too
    assert len([p for p in mesh["store"].rglob("*") if p.is_file()]) >= 4 * 5
    status = subprocess.run(
        [sys.executable, "-m", "pdmesh", "status", "--json", "--registry-prefix",
         mesh["prefix"]], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    rows = [json.loads(line) for line in status.stdout.splitlines() if line.strip()]
    tiers = [i["kv_tiers"] for r in rows for i in r.get("instances", [])
             if i["role"] == "prefill"]
    assert tiers and tiers[0][2] >= 4  # host hits, as the heartbeat reported them
