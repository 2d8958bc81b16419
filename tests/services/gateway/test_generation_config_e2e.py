"""A request's unset sampling fields take the model's generation config, as vLLM serves
them (--generation-config auto), with --override-generation-config / SGLang's
--preferred-sampling-params laid over; --generation-config vllm takes none; a request's
own values win, but max_new_tokens caps max_tokens (vLLM's get_max_tokens)."""

from __future__ import annotations

import json

import httpx

from pdmesh.shared.engine.generation_defaults import default_sampling
from pdmesh.shared.infra.launcher import Service
from tests.mesh import stop_all
from tests.model_folders import linked_model


def _complete(url: str, **fields) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": [5, 6, 7, 8], "ignore_eos": True,
                         **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_model_s_generation_config_sets_a_request_s_defaults(qwen3_path, tmp_path,
                                                                 registry_prefix):
    model = linked_model(qwen3_path, tmp_path / "model",
                         generation_config={"temperature": 0.0, "max_new_tokens": 3})
    reg = ["--registry-prefix", registry_prefix + "-gencfg"]
    started: list[Service] = []
    try:
        started.append(Service("mixed", ["mixed", str(model), "--served-model-name", "tiny",
                                         "--device", "cpu", "--block-size", "16",
                                         "--max-model-len", "64", *reg], tmp_path))
        urls = {}
        for name, extra in (("auto", []),
                            ("vllm", ["--generation-config", "vllm",
                                      "--override-generation-config",
                                      '{"max_new_tokens": 5, "do_sample": true}',
                                      "--enable-return-hidden-states"])):
            gw = Service("gateway", ["gateway", str(model), "--port", "0",
                                     "--served-model-name", "tiny", *extra, *reg], tmp_path)
            started.append(gw)
            urls[name] = gw.info["http"]
        # auto: greedy (temperature 0) and 3 tokens, whatever the seed
        a, b = (_complete(urls["auto"], seed=s) for s in (1, 2))
        assert a["usage"]["completion_tokens"] == 3
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        # the request's own temperature wins; its max_tokens is capped by max_new_tokens
        # (vLLM's get_max_tokens: the least of them)
        own = {_complete(urls["auto"], max_tokens=8, temperature=1.0, seed=s)["choices"][0][
            "text"] for s in range(4)}
        assert len(own) > 1
        assert _complete(urls["auto"], max_tokens=2)["usage"]["completion_tokens"] == 2
        assert _complete(urls["auto"], max_tokens=8)["usage"]["completion_tokens"] == 3
        # vllm: the model's config unread (temperature 1: seeds differ), the override's
        # max_new_tokens; do_sample is named as without effect
        texts = {_complete(urls["vllm"], seed=s)["choices"][0]["text"] for s in range(4)}
        assert len(texts) > 1
        assert _complete(urls["vllm"], seed=9)["usage"]["completion_tokens"] == 5
        assert "--override-generation-config: without effect: do_sample" in \
            started[2].log_path.read_text()
        check_hidden_states(urls, model)
    finally:
        stop_all(started)


def check_hidden_states(urls: dict, model) -> None:
    """SGLang's return_hidden_states on the gateway started with
    --enable-return-hidden-states: the last fed token's hidden state, streamed (a chunk
    after the finish) or not, as the offline engine has it; refused by the other."""
    import torch

    from pdmesh.shared.engine import LLM, SamplingParams
    from pdmesh.shared.engine.hidden_states import answer_hidden_states

    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "return_hidden_states": True}
    refused = httpx.post(urls["auto"] + "/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400 and "return_hidden_states" in refused.text
    whole = _complete(urls["vllm"], **{k: v for k, v in body.items() if k != "model"})
    got = whole["choices"][0]["hidden_states"]
    with httpx.stream("POST", urls["vllm"] + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    streamed = [c["choices"][0]["hidden_states"] for c in chunks
                if c["choices"] and "hidden_states" in c["choices"][0]]
    assert streamed == [got]
    engine = LLM(str(model), device="cpu", block_size=16).engine
    req = engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3,
                                                          ignore_eos=True,
                                                          return_hidden_states=True))
    while engine.has_unfinished():
        engine.step()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(answer_hidden_states(req)),
                               rtol=1e-3, atol=1e-3)


def test_a_bad_default_is_refused_naming_the_flag(qwen3_path, tmp_path):
    import pytest

    with pytest.raises(ValueError, match="--generation-config.*temperature"):
        default_sampling(qwen3_path, "auto", {"temperature": -1})
    with pytest.raises(ValueError, match="--generation-config: .* not found"):
        default_sampling(qwen3_path, str(tmp_path))
    assert default_sampling(qwen3_path, "vllm", None, {"top_k": 20}) == ({"top_k": 20}, [])


def test_the_offline_llm_takes_the_same_defaults(qwen3_path, tmp_path):
    """vLLM's LLM.generate without SamplingParams samples with the generation config's
    fields; given SamplingParams are used as they are."""
    from pdmesh.shared.engine import LLM, SamplingParams

    model = linked_model(qwen3_path, tmp_path / "model",
                         generation_config={"temperature": 0.0, "max_new_tokens": 3})
    llm = LLM(str(model), device="cpu", dtype="float32", block_size=16)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 3)
    [out] = llm.generate([[5, 6, 7, 8]])
    assert len(out.outputs[0].token_ids) <= 3
    [own] = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(own.outputs[0].token_ids) == 6
    plain = LLM(str(model), device="cpu", dtype="float32", block_size=16,
                generation_config="vllm")
    assert plain.get_default_sampling_params().max_tokens == SamplingParams().max_tokens
