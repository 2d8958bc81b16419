"""The recompute scheduler end to end: a decode instance of two DP ranks with a tiny KV
cache hands requests back when it runs out of blocks; the gateway re-prefills prompt +
tokens so far and continues, and every client - streaming or not - gets exactly the text
of an uninterrupted run."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.infra.launcher import Service
from tests.mesh import stop_all
from tests.prometheus_text import sample

ENGINE = ["--device", "cpu", "--dtype", "float32", "--block-size", "16",
          "--pool-segment-mb", "64"]
MODEL = "tiny"
PROMPTS = [list(range(200 + 31 * i, 236 + 31 * i)) for i in range(6)]
NEW = 64
RECOMPUTE = json.dumps({"scheduler_config": {"recompute_scheduler_enable": True}})


@pytest.fixture(scope="module")
def mesh(qwen3_path, tmp_path_factory, registry_prefix):
    logs = tmp_path_factory.mktemp("recompute-logs")
    reg = ["--registry-prefix", registry_prefix + "-rc"]
    started: list[Service] = []
    try:
        kv = Service("kvstore", ["kvstore", *reg], logs)
        started.append(kv)
        started.append(Service("prefill", ["prefill", str(qwen3_path), "--kvstore", kv.address,
                                           "--served-model-name", MODEL, *ENGINE, *reg], logs,
                               wait=False))
        # 10 blocks of 16 tokens per rank: three 100-token requests do not fit at once
        dec = Service("decode", ["decode", str(qwen3_path), "--kvstore", kv.address,
                                 "--served-model-name", MODEL, "--data-parallel-size", "2",
                                 "--num-kv-blocks", "10", "--additional-config", RECOMPUTE,
                                 *ENGINE, *reg], logs, wait=False)
        started.append(dec)
        for s in started[1:]:  # (loading side by side)
            s.wait_ready()
        gw = Service("gateway", ["gateway", str(qwen3_path), "--port", "0",
                                 "--served-model-name", MODEL, *reg], logs)
        started.append(gw)
        yield {"url": gw.info["http"], "decode": dec, "reg": reg, "logs": logs}
    finally:
        stop_all(started)


@pytest.fixture(scope="module")
def expected(qwen3_path):
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def test_handed_back_requests_finish_with_the_uninterrupted_text(mesh, expected):
    client = openai.OpenAI(base_url=mesh["url"] + "/v1", api_key="x", max_retries=0,
                           timeout=180)

    def one(i: int) -> str:
        args = dict(model=MODEL, prompt=PROMPTS[i], max_tokens=NEW, temperature=0,
                    extra_body={"ignore_eos": True})
        if i % 2:  # every other client streams
            text, reason = "", None
            for chunk in client.completions.create(stream=True, **args):
                if chunk.choices:
                    text += chunk.choices[0].text
                    reason = chunk.choices[0].finish_reason or reason
            assert reason == "length"
            return text
        r = client.completions.create(**args)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == NEW
        return r.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(one, range(len(PROMPTS))))
    assert got == expected
    handed_back = sum(sample(httpx.get(url, timeout=10).text,
                              "pdmesh_requests_recomputed_total")
                      for url in mesh["decode"].info["metrics"])
    print(f"requests handed back: {handed_back:.0f}")
    assert handed_back > 0, "the KV budget never ran out: the test proved nothing"


def test_queue_overflow_is_429_while_admitted_requests_complete(mesh, expected, qwen3_path):
    """The same decode dp=2 mesh behind a gateway that takes two requests at a time:
    the rest of a burst gets 429 with Retry-After at once, the admitted ones finish
    with the uninterrupted text, and the mesh serves on."""
    gw = Service("gateway", ["gateway", str(qwen3_path), "--port", "0",
                             "--served-model-name", MODEL, "--max-queued-requests", "2",
                             *mesh["reg"]], mesh["logs"])
    try:
        def one(i: int) -> tuple[int, str, str | None]:
            r = httpx.post(gw.info["http"] + "/v1/completions", timeout=180, json={
                "model": MODEL, "prompt": PROMPTS[i], "max_tokens": NEW, "temperature": 0,
                "ignore_eos": True})
            if r.status_code == 200:
                return 200, r.json()["choices"][0]["text"], None
            return r.status_code, r.json()["error"]["message"], r.headers.get("retry-after")

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(one, range(len(PROMPTS))))
        refused = [a for a in answers if a[0] == 429]
        served = [(i, a) for i, a in enumerate(answers) if a[0] == 200]
        assert refused and served, answers
        assert all(a[2] == "1" and "--max-queued-requests" in a[1] for a in refused)
        assert all(a[1] == expected[i] for i, a in served)
        assert len(refused) + len(served) == len(PROMPTS)
        assert one(0) == (200, expected[0], None)  # and it serves on
    finally:
        gw.stop()
