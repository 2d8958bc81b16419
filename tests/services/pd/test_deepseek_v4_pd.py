"""DeepSeek-V4 through the whole mesh. PD: prefill stores the compressed history
(entries, indexer keys) and the blocks of the sliding window (window K=V, compressor
inputs) in the real Mooncake pool, decode continues exactly from them; the OpenAI API
answers what the offline engine does, streaming and not. `pdmesh up` on the same
checkpoint does too."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from pdmesh.shared.engine import LLM, SamplingParams
from tests.mesh import MODEL, pd_mesh
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
        _ask_both_ways(url, path.name, texts)
    finally:
        shut(proc, prefix)
