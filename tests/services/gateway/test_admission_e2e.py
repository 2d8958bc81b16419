"""Admission control with real processes: a mixed instance (one seat, two waiting places:
--max-num-seqs 1 --max-queued-requests 2) behind two gateways, one with
--max-queued-requests 2 (so the instance never refuses its traffic) and one without a
limit. Overflow at either level is a 429 with Retry-After and an OpenAI error body; every
admitted request completes with the greedy text; the mesh serves on afterwards. (The
mesh also serves the prompt_logprobs test of the mixed path.)"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.infra.launcher import Service
from tests.mesh import stop_all
from tests.shared.engine.hf_reference import assert_like_reference, from_json, hf_prompt_logprobs

MODEL = "tiny"
# long enough that the three requests the instance holds (one running, two waiting) keep
# it full for seconds: the burst's last arrivals find it full even when a loaded machine
# spreads the eight over a second or more
MAX_TOKENS = 256


@pytest.fixture(scope="module")
def mesh(qwen3_path, tmp_path_factory, registry_prefix):
    logs = tmp_path_factory.mktemp("admission-logs")
    reg = ["--registry-prefix", registry_prefix + "-adm"]
    started: list[Service] = []
    try:
        started.append(Service("mixed", [
            "mixed", "--model", str(qwen3_path), "--served-model-name", MODEL,
            "--device", "cpu", "--dtype", "float32", "--block-size", "16",
            "--max-num-seqs", "1", "--max-queued-requests", "2", *reg], logs))
        gateways = {}
        for name, extra in (("limited", ["--max-queued-requests", "2"]), ("open", [])):
            gw = Service("gateway", ["gateway", "--model", str(qwen3_path), "--port", "0",
                                     "--served-model-name", MODEL, *extra, *reg], logs)
            started.append(gw)
            gateways[name] = gw.info["http"]
        yield gateways
    finally:
        stop_all(started)


@pytest.fixture(scope="module")
def expected(qwen3_path):
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)
    prompts = [list(range(200 + 9 * i, 230 + 9 * i)) for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True))
    return [(p, o.outputs[0].text) for p, o in zip(prompts, outs, strict=True)]


def complete(base: str, prompt: list[int], stream: bool) -> tuple[int, dict, str | None]:
    """(status, headers or the error body, text of a success)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", base + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, {"retry-after": r.headers.get("retry-after"),
                                       **r.json()}, None
            if not stream:
                r.read()
                return 200, {}, r.json()["choices"][0]["text"]
            parts = []
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                parts.append(event["choices"][0]["text"])
            return 200, {}, "".join(parts)


def burst(base: str, expected) -> list[tuple[int, dict, str | None]]:
    """All eight at once, alternating streaming and not."""
    go = threading.Barrier(len(expected))

    def one(i: int):
        go.wait()
        return complete(base, expected[i][0], stream=i % 2 == 0)

    with ThreadPoolExecutor(len(expected)) as pool:
        return list(pool.map(one, range(len(expected))))


def check(results, expected) -> int:
    """Admitted requests have the greedy text, refused ones a proper 429; the count
    of refused ones."""
    refused = 0
    for (status, info, text), (_, want) in zip(results, expected, strict=True):
        if status == 429:
            refused += 1
            assert info["retry-after"] == "1"
            assert info["error"]["code"] == 429
            assert info["error"]["type"] == "rate_limit_error"
            assert "--max-queued-requests" in info["error"]["message"]
        else:
            assert status == 200, info
            assert text == want
    return refused


def test_gateway_limit_refuses_overflow_and_admitted_requests_finish(mesh, expected):
    results = burst(mesh["limited"], expected)
    refused = check(results, expected)
    assert 1 <= refused <= len(expected) - 2, results
    assert all("in flight" in info["error"]["message"] for s, info, _ in results if s == 429)
    status, _, text = complete(mesh["limited"], expected[0][0], stream=True)
    assert (status, text) == (200, expected[0][1])  # serving on


def test_instance_limit_becomes_429_at_the_gateway(mesh, expected):
    results = burst(mesh["open"], expected)
    refused = check(results, expected)
    assert 1 <= refused <= len(expected) - 2, results  # the first two always wait there
    assert all("every mixed instance" in info["error"]["message"]
               for s, info, _ in results if s == 429)
    status, _, text = complete(mesh["open"], expected[1][0], stream=False)
    assert (status, text) == (200, expected[1][1])


def test_prompt_logprobs_computed_by_a_mixed_instance(mesh, qwen3_path):
    """(The mesh's other path: no prefill instance.) prompt_logprobs equal a direct
    forward pass, also when the prompt is in the instance's prefix cache already."""
    prompt = list(range(600, 650))
    ref = hf_prompt_logprobs(qwen3_path, prompt)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    with httpx.Client(timeout=60) as client:
        client.post(mesh["open"] + "/v1/completions", json=body)  # into its prefix cache
        r = client.post(mesh["open"] + "/v1/completions",
                        json={**body, "prompt_logprobs": 3}).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert_like_reference(from_json(r["choices"][0]["prompt_logprobs"]), prompt, ref, 3)
