"""LoRA adapters through the PD mesh, as real processes on loopback: `--lora-modules` on
the gateway, the prefill and the decode instance; a request's `model` names an adapter
(vLLM's way) and gets the offline engine's text with that adapter, prefilled and decoded
with it; `/v1/models` lists the adapters under their base; a name nobody serves is a 404
in OpenAI's shape."""

from __future__ import annotations

import time

import openai
import pytest

from pdmesh.shared.engine import LLM, LoRARequest, SamplingParams
from tests.mesh import MODEL, pd_mesh
from tests.shared.engine.lora_reference import make_adapters

PROMPTS = [list(range(400, 431)), list(range(700, 712))]
NEW = 12


@pytest.fixture(scope="module")
def adapters(qwen3_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-e2e")
    return make_adapters(qwen3_path, root, "qwen3", [(4, 8.0, False), (8, 8.0, False)],
                         seed=3)


@pytest.fixture(scope="module")
def mesh(qwen3_path, adapters, tmp_path_factory, registry_prefix):
    flags = ["--lora-modules", f"sql={adapters[0]}", f"chat={adapters[1]}"]
    engine = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", *flags]
    with pd_mesh(qwen3_path, tmp_path_factory.mktemp("lora-logs"),
                 f"{registry_prefix}-lora-{time.monotonic_ns()}", gateway_args=flags,
                 prefill_args=engine, decode_args=engine) as services:
        yield services


def test_a_request_s_model_picks_its_adapter_through_prefill_and_decode(mesh, qwen3_path,
                                                                        adapters):
    offline = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16,
                  enable_lora=True, max_loras=2, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    expected = {name: [o.outputs[0].text for o in offline.generate(
        PROMPTS, params, lora_request=None if path is None else LoRARequest(name, i, str(path)))]
        for i, (name, path) in enumerate((("sql", adapters[0]), ("chat", adapters[1]),
                                          (MODEL, None)), start=1)}
    assert len({tuple(v) for v in expected.values()}) == 3
    client = openai.OpenAI(base_url=mesh["gateway"].info["http"] + "/v1", api_key="x",
                           max_retries=0, timeout=120)
    for name, texts in expected.items():
        for prompt, text in zip(PROMPTS, texts, strict=True):
            r = client.completions.create(model=name, prompt=prompt, max_tokens=NEW,
                                          temperature=0, extra_body={"ignore_eos": True})
            assert r.choices[0].text == text, name
            assert r.model == name
    # streamed, the same text
    stream = client.completions.create(model="sql", prompt=PROMPTS[0], max_tokens=NEW,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == expected["sql"][0]
    # SGLang's lora_path field, by name or by folder, over the base model's name
    for given in ("chat", str(adapters[1])):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=NEW,
                                      temperature=0, extra_body={"ignore_eos": True,
                                                                 "lora_path": given})
        assert r.choices[0].text == expected["chat"][1]


def test_models_lists_the_adapters_and_an_unknown_one_is_a_404(mesh, adapters):
    client = openai.OpenAI(base_url=mesh["gateway"].info["http"] + "/v1", api_key="x",
                           max_retries=0, timeout=60)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "sql", "chat"}
    assert cards["sql"].parent == MODEL and cards["sql"].root == str(adapters[0])
    assert cards[MODEL].parent is None
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nobody", prompt=PROMPTS[0], max_tokens=2)
    assert "nobody" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2,
                                  extra_body={"lora_path": "/not/here"})
    assert "lora_path" in str(e.value)
