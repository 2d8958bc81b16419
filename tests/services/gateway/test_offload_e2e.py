"""Prefill offload with real processes: a PD mesh (kvstore, prefill, decode, gateway
with --prefill-offload-threshold 1). A burst backs prefill up, so the decode instance
computes some prompts itself (once the engines have published their step costs, which
price each prompt against the decode TPOT budget, here wide); every answer is still the offline
greedy text, and a request on an idle mesh goes through prefill as usual."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.infra.registry import Registry
from tests.mesh import MODEL, pd_mesh
from tests.prometheus_text import sample

MAX_TOKENS = 24
PROMPTS = [list(range(300 + 37 * i, 500 + 37 * i)) for i in range(10)]  # 200 tokens each


@pytest.fixture(scope="module")
def mesh(qwen3_path, tmp_path_factory, registry_prefix):
    # the TPOT budget wide open: how the budget prices a prompt is test_router.py's
    # subject; here it would hang on how busy the machine is (a loaded test box measures
    # step costs that price every prompt out, and nothing is offloaded)
    with pd_mesh(qwen3_path, tmp_path_factory.mktemp("offload-logs"),
                 registry_prefix + "-offload",
                 gateway_args=["--prefill-offload-threshold", "1",
                               "--decode-tpot-slo-ms", "600000"]) as services:
        yield services["gateway"].info["http"]


@pytest.fixture(scope="module")
def expected(qwen3_path):
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def complete(base: str, prompt: list[int]) -> dict:
    r = httpx.post(base + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def offloaded(base: str) -> float:
    return sample(httpx.get(base + "/metrics", timeout=10).text,
                  "pdmesh_requests_offloaded_total")


def test_idle_mesh_does_not_offload(mesh, expected):
    before = offloaded(mesh)
    for prompt, want in zip(PROMPTS[:2], expected[:2], strict=True):
        assert complete(mesh, prompt)["choices"][0]["text"] == want
    assert offloaded(mesh) == before, "offloaded on an idle mesh"


def costs_published(prefix: str, timeout_s: float = 30.0) -> None:
    """Wait for the prefill instance's heartbeat to carry its measured cost per prompt
    token: until then the gateway cannot price a prompt on a decode instance, and
    offloads nothing (decode protected by construction)."""
    reg = Registry("redis://127.0.0.1:6379/0", prefix)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(i.load.get("prefill_ns_per_token") for i in reg.instances("prefill")):
            return
        time.sleep(0.1)
    raise AssertionError("the prefill instance never published its step costs")


def test_burst_offloads_some_prompts_to_decode_with_the_same_text(mesh, expected,
                                                                   registry_prefix):
    costs_published(registry_prefix + "-offload")
    time.sleep(0.5)  # the gateway's registry copy is refreshed every 0.25 s
    before = offloaded(mesh)
    go = threading.Barrier(len(PROMPTS))

    def one(i: int) -> dict:
        go.wait()
        return complete(mesh, PROMPTS[i])

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(one, range(len(PROMPTS))))
    texts = [a["choices"][0]["text"] for a in answers]
    assert texts == expected, [i for i, t in enumerate(texts) if t != expected[i]]
    for a in answers:
        assert a["usage"]["completion_tokens"] == MAX_TOKENS
        assert isinstance(a["usage"]["prompt_tokens_details"]["cached_tokens"], int)
    moved = offloaded(mesh) - before
    assert 1 <= moved < len(PROMPTS), moved  # some, not all: prefill kept its share
