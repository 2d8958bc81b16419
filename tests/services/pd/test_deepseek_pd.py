"""DeepSeek-V3 through the whole PD mesh: prefill stores MLA's latent blocks in the real
Mooncake pool, decode continues from them, and the OpenAI API answers exactly what the
offline engine does, streaming and not; the pool moves the latent's bytes only."""

from __future__ import annotations

import httpx
import openai
import pytest

from pdmesh.shared.engine import LLM, SamplingParams
from tests.mesh import MODEL, pd_mesh

PROMPTS = [list(range(300, 347)), [7, 8, 9], list(range(1000, 1100))]
NEW = 16
BLOCK = 16  # tests/mesh.py's --block-size


@pytest.fixture(scope="module")
def mesh(tiny_models, tmp_path_factory, registry_prefix):
    lora = ["--enable-lora", "--max-lora-rank", "8"]
    with pd_mesh(tiny_models["deepseek_v3"], tmp_path_factory.mktemp("ds-pd"),
                 f"{registry_prefix}-ds", prefill_args=lora, decode_args=lora) as services:
        yield services


@pytest.fixture(scope="module")
def offline(tiny_models):
    llm = LLM(str(tiny_models["deepseek_v3"]), device="cpu", dtype="float32", block_size=BLOCK)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    return [o.outputs[0].text for o in outs], llm.engine.kv_bytes_per_token


def test_answers_equal_the_offline_engine_streaming_and_not(mesh, offline):
    texts, _ = offline
    client = openai.OpenAI(base_url=mesh["gateway"].info["http"] + "/v1", api_key="x",
                           max_retries=0, timeout=120)
    for prompt, want in zip(PROMPTS, texts, strict=True):
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert whole.choices[0].text == want
        streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed) == want


def test_the_pool_moves_latent_blocks(mesh, offline):
    _, per_token = offline
    assert mesh["prefill"].info["kv_bytes_per_token"] == per_token
    text = httpx.get(mesh["prefill"].info["metrics"], timeout=10).text
    put = next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdmesh_kv_transfer_bytes_total") and 'direction="put"' in line)
    # every prompt above went through prefill twice (whole, streamed): its blocks, the
    # partial tail included, each a whole block of latents (a put of a block already in
    # the pool moves nothing)
    blocks = sum(-(-len(p) // BLOCK) for p in PROMPTS)
    assert per_token * BLOCK * blocks <= put <= 2 * per_token * BLOCK * blocks


def test_an_adapter_runs_through_pd_and_keeps_its_own_kv(mesh, tiny_models, tmp_path):
    """A LoRA adapter on MLA's projections (loaded at runtime) through prefill, the pool
    and decode: the offline engine's text with it; its prompt finds none of the base
    model's cached blocks (in the prefill instance's cache or the pool), only its own."""
    from pdmesh.shared.engine import LoRARequest
    from tests.shared.engine.lora_reference import make_adapters

    base = tiny_models["deepseek_v3"]
    [adapter] = make_adapters(base, tmp_path, "deepseek_v3", [(8, 16.0, False)], 4)
    url = mesh["gateway"].info["http"]
    r = httpx.post(url + "/v1/load_lora_adapter", timeout=60,
                   json={"lora_name": "mla", "lora_path": str(adapter)})
    assert r.status_code == 200, r.text
    prompt = list(range(2000, 2100))
    llm = LLM(str(base), device="cpu", dtype="float32", block_size=BLOCK, enable_lora=True,
              max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    want = llm.generate([prompt], params, lora_request=LoRARequest("mla", 1, str(adapter)))
    plain = llm.generate([prompt], params)
    assert want[0].outputs[0].text != plain[0].outputs[0].text

    def ask(model: str) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0,
                "ignore_eos": True}
        return httpx.post(url + "/v1/completions", json=body, timeout=120).json()

    assert ask(MODEL)["choices"][0]["text"] == plain[0].outputs[0].text  # (cached now)
    first, again = ask("mla"), ask("mla")
    assert first["choices"][0]["text"] == again["choices"][0]["text"] == \
        want[0].outputs[0].text
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK * 6


def test_a_batch_mixing_three_adapters_and_the_base_matches_peft(mesh, tiny_models, tmp_path):
    """DeepSeek-V3: three adapters on MLA's projections loaded at runtime and the base
    model in one batch through the PD mesh (one device slot: the adapters take turns),
    token for token transformers + PEFT's."""
    from tests.services.pd.lora_mesh import mixed_batch

    got, want = mixed_batch(mesh["gateway"].info["http"], MODEL, tiny_models["deepseek_v3"],
                            "deepseek_v3", tmp_path)
    assert len({str(want[k]) for k in (0, 3, 4)}) == 3  # each adapter tells
    assert got == want
