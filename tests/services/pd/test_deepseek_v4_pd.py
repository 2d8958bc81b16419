"""DeepSeek-V4 through the whole mesh. PD: prefill stores the compressed history
(entries, indexer keys) and the blocks of the sliding window (window K=V, compressor
inputs) in the real Mooncake pool, decode continues exactly from them; the OpenAI API
answers what the offline engine does, streaming and not. `pdmesh up` on the same
checkpoint does too, and so does a decode instance of two DP ranks that runs out of
blocks and hands requests back."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from pdmesh.shared.engine import LLM, SamplingParams
from tests.mesh import MODEL, pd_mesh
from tests.prometheus_text import sample
from tests.shared.cli.test_up import launch, shut

_g = torch.Generator().manual_seed(9)
# across the window (16) and several compression windows (4 and 16); mid-block ends
PROMPTS = [torch.randint(10, 4000, (n,), generator=_g).tolist() for n in (101, 3, 47, 200)]
NEW = 16
BLOCK = 16  # tests/mesh.py's --block-size


@pytest.fixture(scope="module")
def offline(tiny_models):
    llm = LLM(str(tiny_models["deepseek_v4"]), device="cpu", dtype="float32", block_size=BLOCK)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    return [o.outputs[0].text for o in outs], llm.engine


def _ask_both_ways(url: str, model: str, texts: list[str]) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    for prompt, want in zip(PROMPTS, texts, strict=True):
        whole = client.completions.create(model=model, prompt=prompt, max_tokens=NEW,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert whole.choices[0].text == want
        streamed = client.completions.create(model=model, prompt=prompt, max_tokens=NEW,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed) == want


def _counter(url: str, direction: str) -> float:
    text = httpx.get(url, timeout=10).text
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("pdmesh_kv_transfer_bytes_total")
                and f'direction="{direction}"' in line)


def test_pd_mesh_answers_equal_the_offline_engine_and_the_pool_moves_both_groups(
        tiny_models, tmp_path_factory, registry_prefix, offline):
    texts, engine = offline
    spec = engine.cache_spec
    history, window = (g.block_bytes(torch.float32) for g in spec.groups)
    with pd_mesh(tiny_models["deepseek_v4"], tmp_path_factory.mktemp("ds4-pd"),
                 f"{registry_prefix}-ds4") as mesh:
        assert mesh["prefill"].info["kv_bytes_per_token"] == engine.kv_bytes_per_token
        _ask_both_ways(mesh["gateway"].info["http"], MODEL, texts)
        put = _counter(mesh["prefill"].info["metrics"], "put")
        got = _counter(mesh["decode"].info["metrics"], "get")
    # per prompt: every history block, and the window blocks where decode continues
    # (from the prompt's end, less the window); the prompts went through twice
    # (whole, streamed), and a block already in the pool is not moved again
    once = 0
    for p in PROMPTS:
        blocks = -(-len(p) // BLOCK)
        first = max(0, len(p) - spec.groups[1].window) // BLOCK
        once += blocks * history + (blocks - first) * window
    assert once <= put <= 2 * once
    # decode loaded what prefill stored (it computed nothing of the prompts again)
    assert once <= got <= 2 * once


def test_pdmesh_up_serves_it_like_the_offline_engine(tiny_models, tmp_path, registry_prefix,
                                                      offline):
    texts, _ = offline
    path = tiny_models["deepseek_v4"]
    prefix = f"{registry_prefix}-up-ds4"
    proc, url, out = launch("up", str(path), "--port", "0", "--registry-prefix", prefix,
                            "--log-dir", str(tmp_path), "--engine-args",
                            f"--device cpu --dtype float32 --block-size {BLOCK} "
                            "--pool-segment-mb 64")
    try:
        assert url, "".join(out)
        _ask_both_ways(url, str(path), texts)
    finally:
        shut(proc, prefix)


RECOMPUTE = json.dumps({"scheduler_config": {"recompute_scheduler_enable": True}})
HAND_BACK_PROMPTS = [list(range(200 + 31 * i, 236 + 31 * i)) for i in range(4)]
HAND_BACK_NEW = 64


def test_handed_back_requests_over_two_dp_ranks_finish_with_the_uninterrupted_text(
        tiny_models, tmp_path_factory, registry_prefix):
    """A decode instance of two DP ranks whose history group holds 10 blocks per rank:
    requests run out of blocks and are handed back; the gateway re-prefills prompt +
    tokens so far (the window and compressor state recomputed with them) and every
    client, streaming or not, gets the text of an uninterrupted run."""
    path = tiny_models["deepseek_v4"]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=BLOCK)
    params = SamplingParams(temperature=0, max_tokens=HAND_BACK_NEW, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(HAND_BACK_PROMPTS, params)]
    with pd_mesh(path, tmp_path_factory.mktemp("ds4-rc"), f"{registry_prefix}-ds4-rc",
                 decode_args=["--data-parallel-size", "2", "--num-kv-blocks", "10",
                              "--additional-config", RECOMPUTE]) as mesh:
        client = openai.OpenAI(base_url=mesh["gateway"].info["http"] + "/v1", api_key="x",
                               max_retries=0, timeout=180)

        def one(i: int) -> str:
            args = dict(model=MODEL, prompt=HAND_BACK_PROMPTS[i], max_tokens=HAND_BACK_NEW,
                        temperature=0, extra_body={"ignore_eos": True})
            if i % 2:
                return "".join(c.choices[0].text for c in
                               client.completions.create(stream=True, **args) if c.choices)
            return client.completions.create(**args).choices[0].text

        with ThreadPoolExecutor(len(HAND_BACK_PROMPTS)) as pool:
            got = list(pool.map(one, range(len(HAND_BACK_PROMPTS))))
        handed_back = sum(sample(httpx.get(url, timeout=10).text,
                                 "pdmesh_requests_recomputed_total")
                          for url in mesh["decode"].info["metrics"])
    assert got == expected
    assert handed_back > 0, "the KV budget never ran out: the test proved nothing"
