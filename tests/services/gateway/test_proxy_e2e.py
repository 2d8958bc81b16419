"""`pdmesh proxy`: vLLM-Ascend's PD proxy line (load_balance_proxy_server_example.py)
runs as the gateway and routes to the P and D instances it names, never to others the
registry lists; with no model on the line, it takes the folder and served name the
instances report."""

from __future__ import annotations

import httpx

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.infra.launcher import Service
from tests.mesh import ENGINE, MODEL, stop_all
from tests.services.test_metrics_e2e import scrape


def _generated(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("pdmesh_generation_tokens_total"))


def test_the_proxy_line_routes_to_the_instances_it_names(qwen3_path, tmp_path,
                                                        registry_prefix):
    reg = ["--registry-prefix", registry_prefix + "-proxy"]
    started: list[Service] = []
    try:
        kv = Service("kvstore", ["kvstore", *reg], tmp_path)
        started.append(kv)
        engines = {name: Service(role, [role, str(qwen3_path), "--kvstore", kv.address,
                                        "--served-model-name", MODEL, *ENGINE, *reg],
                                 tmp_path, wait=False)
                   for name, role in (("prefill", "prefill"), ("decode", "decode"),
                                      ("other", "decode"))}
        started += engines.values()
        for s in engines.values():
            s.wait_ready()
        pre, dec = engines["prefill"].address, engines["decode"].address
        proxy = Service("gateway", [
            "proxy", "--host", "127.0.0.1", "--port", "0",
            "--prefiller-hosts", pre.rpartition(":")[0],
            "--prefiller-ports", pre.rpartition(":")[2],
            "--decoder-hosts", dec.rpartition(":")[0], "--decoder-ports", dec.rpartition(":")[2],
            "--max-retries", "3", *reg], tmp_path)
        started.append(proxy)
        assert "--max-retries: without effect" in proxy.log_path.read_text()
        url = proxy.info["http"]
        models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == [MODEL]  # the instances' served name
        prompts = [[5, 6, 7, 8], [30, 31, 32, 33, 34, 9, 9, 9]]
        want = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16).generate(
            prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        for prompt, expected in zip(prompts, want, strict=True):
            r = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected.outputs[0].text
        # every decode step ran on the named decode instance, none on the other
        assert _generated(scrape(engines["decode"].info["metrics"])) == len(prompts) * 5
        assert _generated(scrape(engines["other"].info["metrics"])) == 0
    finally:
        stop_all(started)
