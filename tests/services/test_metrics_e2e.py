"""Every service's /metrics after a few requests, as Prometheus would scrape them: the
counters moved by exactly what was sent, and the exported names are the catalogue's
(pdmesh.shared.infra.metrics.METRIC_NAMES) that dashboards use."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from pdmesh.shared.infra.metrics import METRIC_NAMES
from tests.mesh import MODEL, pd_mesh

PROMPTS = [list(range(100 + 9 * i, 140 + 13 * i)) for i in range(5)]
NEW = 12


@pytest.fixture(scope="module")
def mesh(qwen3_path, tmp_path_factory, registry_prefix):
    with pd_mesh(qwen3_path, tmp_path_factory.mktemp("metrics-logs"),
                 registry_prefix + "-metrics") as services:
        yield {"url": services["gateway"].info["http"], "prefill": services["prefill"],
               "decode": services["decode"]}


def scrape(url: str) -> dict[str, float]:
    """name{labels} -> value, plus bare family names -> summed value."""
    out: dict[str, float] = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        out[key] = float(value)
        family = re.match(r"[a-zA-Z_:][\w:]*", key).group(0)
        out.setdefault("__" + family, 0.0)
        out["__" + family] += float(value)
    return out


def total(samples: dict[str, float], name: str) -> float:
    assert "__" + name in samples, f"{name} is not exported"
    return samples["__" + name]


def test_counters_move_by_exactly_what_was_sent(mesh):
    client = openai.OpenAI(base_url=mesh["url"] + "/v1", api_key="x", max_retries=0,
                           timeout=60)
    for i, prompt in enumerate(PROMPTS):
        args = dict(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0,
                    extra_body={"ignore_eos": True})
        if i % 2:
            list(client.completions.create(stream=True, **args))
        else:
            client.completions.create(**args)
    n, prompt_tokens = len(PROMPTS), sum(map(len, PROMPTS))
    gw = scrape(mesh["url"] + "/metrics")
    assert gw['pdmesh_request_success_total{finished_reason="length",model_name="tiny"}'] == n
    assert total(gw, "pdmesh_prompt_tokens_total") == prompt_tokens
    assert total(gw, "pdmesh_generation_tokens_total") == n * NEW
    assert total(gw, "pdmesh_time_to_first_token_seconds_count") == n
    assert total(gw, "pdmesh_inter_token_latency_seconds_count") == n * (NEW - 1)
    assert total(gw, "pdmesh_e2e_request_latency_seconds_count") == n
    assert total(gw, "pdmesh_request_time_per_output_token_seconds_count") == n  # TPOT
    assert total(gw, "pdmesh_request_prompt_tokens_sum") == prompt_tokens
    assert total(gw, "pdmesh_request_generation_tokens_sum") == n * NEW
    assert gw['pdmesh_request_generation_tokens_bucket{le="10.0",model_name="tiny"}'] == 0
    assert gw['pdmesh_request_generation_tokens_bucket{le="20.0",model_name="tiny"}'] == n
    assert total(gw, "pdmesh_instance_up") == 2  # one prefill, one decode
    pre = scrape(mesh["prefill"].info["metrics"])
    assert total(pre, "pdmesh_prompt_tokens_total") == prompt_tokens
    assert total(pre, "pdmesh_generation_tokens_total") == n  # the first token each
    assert total(pre, "pdmesh_request_queue_time_seconds_count") == n
    assert pre[_key(pre, "pdmesh_kv_transfer_bytes_total", 'direction="put"')] > 0
    dec = scrape(mesh["decode"].info["metrics"])
    assert total(dec, "pdmesh_generation_tokens_total") == n * (NEW - 1)
    assert total(dec, "pdmesh_request_decode_time_seconds_count") == n
    assert dec[_key(dec, "pdmesh_kv_transfer_bytes_total", 'direction="get"')] > 0
    assert total(dec, "pdmesh_kv_pool_hits_total") > 0
    # every sample is labelled as the catalogue says
    assert re.search(r'pdmesh_num_requests_running\{[^}]*dp_rank="0"[^}]*'
                     r'role="decode"', "\n".join(dec)), list(dec)[:5]
    # the names exported are the catalogue's: nothing unlisted, nothing listed missing
    # (DyntraLB, expert parallelism and the EPLB controller export theirs elsewhere)
    exported = {k[2:] for s in (gw, pre, dec) for k in s if k.startswith("__pdmesh_")}
    assert not [k for k in exported if k.endswith("_created")]
    families = {re.sub(r"_(bucket|sum|count)$", "", k) for k in exported}
    unconditional = {m for m, where in METRIC_NAMES.items()
                     if "(" not in where and where != "eplb"}
    assert unconditional <= families, unconditional - families
    assert families <= set(METRIC_NAMES), families - set(METRIC_NAMES)


def _key(samples: dict[str, float], name: str, label: str) -> str:
    found = [k for k in samples if k.startswith(name + "{") and label in k]
    assert found, f"no {name} sample with {label}"
    return found[0]


def test_vllm_names_for_vllm_dashboards(qwen3_path, tmp_path, registry_prefix):
    """--metrics-names vllm: the same families as vLLM names them (vllm:X), gateway and
    engines alike."""
    flag = ["--metrics-names", "vllm"]
    with pd_mesh(qwen3_path, tmp_path, registry_prefix + "-vllm-names", gateway_args=flag,
                 prefill_args=flag, decode_args=flag) as services:
        url = services["gateway"].info["http"]
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        gw = scrape(url + "/metrics")
        dec = scrape(services["decode"].info["metrics"])
    for samples, names in ((gw, ("vllm:time_to_first_token_seconds_count",
                                 "vllm:request_time_per_output_token_seconds_count",
                                 "vllm:e2e_request_latency_seconds_count",
                                 "vllm:request_success_total", "vllm:prompt_tokens_total",
                                 "vllm:request_prompt_tokens_count")),
                           (dec, ("vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                                  "vllm:generation_tokens_total"))):
        for name in names:  # each there; what counts, counted
            value = total(samples, name)
            assert value > 0 or not name.endswith(("_total", "_count")), name
        assert not [k for k in samples if "pdmesh_" in k]


def test_n_choices_compute_the_prompt_once(mesh):
    """n=4: four choices, the prompt's full blocks computed for the first only (the
    other three find them cached); so with prompt_logprobs, which the first computes
    for all."""
    prompt = list(range(1500, 1570))  # 4 full blocks of 16, and 6 more
    before = scrape(mesh["prefill"].info["metrics"])
    client = openai.OpenAI(base_url=mesh["url"] + "/v1", api_key="x", max_retries=0,
                           timeout=60)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, n=4,
                                  temperature=1.0, seed=1)
    assert len(r.choices) == 4
    after = scrape(mesh["prefill"].info["metrics"])

    def moved(name: str) -> float:
        return total(after, name) - total(before, name)

    assert moved("pdmesh_prefix_cache_queries_total") == 4 * len(prompt)
    assert moved("pdmesh_prefix_cache_hits_total") >= 3 * 64
    # with prompt logprobs too: the first choice computes them, the others reuse both
    prompt = list(range(1600, 1670))
    before = scrape(mesh["prefill"].info["metrics"])
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, n=3,
                                  temperature=1.0, seed=1, extra_body={"prompt_logprobs": 1})
    after = scrape(mesh["prefill"].info["metrics"])
    logprobs = [c.model_extra["prompt_logprobs"] for c in r.choices]
    assert len(logprobs[0]) == len(prompt) and logprobs[1:] == logprobs[:1] * 2
    assert moved("pdmesh_prefix_cache_hits_total") >= 2 * 64
