"""DeepSeek-V4 through the whole mesh. PD: prefill stores the compressed history
(entries, indexer keys) and the blocks of the sliding window (window K=V, compressor
inputs) in the real Mooncake pool, decode continues exactly from them; the OpenAI API
answers what the offline engine does, streaming and not, and LoRA adapters' answers are
transformers + PEFT's. The gateway serves it as the
seeds' recipes do (V4's encoding, tool-call and reasoning parsers). `pdmesh up` on the
same checkpoint does too, and so does a decode instance of two DP ranks that runs out of
blocks and hands requests back."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.infra.launcher import Service
from pdmesh.shared.models import Tokenizer
from pdmesh.shared.models import encoding_dsv4 as dsv4
from tests.mesh import MODEL, pd_mesh
from tests.prometheus_text import sample
from tests.services.pd.lora_mesh import mixed_batch
from tests.shared.cli.test_up import launch, shut

_g = torch.Generator().manual_seed(9)
# across the window (16) and several compression windows (4 and 16); mid-block ends
PROMPTS = [torch.randint(10, 4000, (n,), generator=_g).tolist() for n in (101, 3, 47, 200)]
NEW = 16
BLOCK = 16  # tests/mesh.py's --block-size
# the gateway flags every seed recipe starts DeepSeek-V4 with
RECIPE = ["--tokenizer-mode", "deepseek_v4", "--tool-call-parser", "deepseek_v4",
          "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_v4"]


@pytest.fixture(scope="module")
def mesh(tiny_models, tmp_path_factory, registry_prefix):
    """The PD mesh behind the recipes' gateway, and ["forcing"]: a second gateway whose
    grammars bind the reasoning too (a random model never closes it by itself)."""
    logs = tmp_path_factory.mktemp("ds4-pd")
    prefix = f"{registry_prefix}-ds4"
    lora = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "8"]
    with pd_mesh(tiny_models["deepseek_v4"], logs, prefix, gateway_args=RECIPE,
                 prefill_args=lora, decode_args=lora) as mesh:
        forcing = Service("gateway", ["gateway", str(tiny_models["deepseek_v4"]), "--port",
                                      "0", "--served-model-name", MODEL, *RECIPE,
                                      "--structured-outputs-config",
                                      '{"enable_in_reasoning": true}',
                                      "--registry-prefix", prefix], logs)
        try:
            yield {**mesh, "forcing": forcing}
        finally:
            forcing.stop()


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
        mesh, offline):
    texts, engine = offline
    spec = engine.cache_spec
    history, window = (g.block_bytes(torch.float32) for g in spec.groups)
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


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
ASK = [{"role": "user", "content": "weather in Paris?"}]
CALL = {"role": "assistant", "content": "", "reasoning_content": "the user asks for it",
        "tool_calls": [{"id": "call_0", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]}


def test_chats_tools_and_thinking_as_the_recipes_serve_them(mesh, tiny_models):
    """With the recipes' flags the gateway renders chats with V4's encoding into V4's
    tokens (tools, history calls and results, thinking on and off), and reads the
    model's reasoning and DSML tool calls back: what the encoding writes for an
    assistant turn, forced as the output, comes back as that turn's reasoning and call,
    whole and streamed."""
    url = mesh["gateway"].info["http"]
    tok = Tokenizer(tiny_models["deepseek_v4"], mode="deepseek_v4")
    history = [*ASK, {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}]
    for thinking in (True, False):
        asked = {"model": MODEL, "messages": history, "tools": [WEATHER],
                 "chat_template_kwargs": {"thinking": thinking}}
        got = httpx.post(url + "/tokenize", json=asked, timeout=30).json()["tokens"]
        text = dsv4.encode_messages([*ASK, CALL, history[2]], tools=[WEATHER],
                                    thinking=thinking)
        assert got == tok.encode(text, add_special_tokens=False)
        assert got[0] == tok.bos_token_id and text.endswith(
            dsv4.ASSISTANT + (dsv4.THINK_START if thinking else dsv4.THINK_END))
    prompt = dsv4.encode_messages(ASK, tools=[WEATHER], thinking=True)
    turn = dsv4.encode_messages([*ASK, CALL], tools=[WEATHER], thinking=True,
                                add_generation_prompt=False)
    assert turn.startswith(prompt) and turn.endswith(dsv4.EOS)
    output = turn[len(prompt):-len(dsv4.EOS)]
    client = openai.OpenAI(base_url=mesh["forcing"].info["http"] + "/v1", api_key="x",
                           max_retries=0, timeout=120)
    ask = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=300, temperature=0,
               extra_body={"guided_choice": [output],
                           "chat_template_kwargs": {"thinking": True}})
    r = client.chat.completions.create(**ask)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", msg
    # (the blank line V4 writes between </think> and its calls is the content)
    assert msg.reasoning == CALL["reasoning_content"] and not msg.content.strip()
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] \
        == [("get_weather", {"city": "Paris", "days": 3})]
    reasoning, args, reason = "", "", None
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            args += "".join(t.function.arguments or "" for t in choice.delta.tool_calls or [])
            reason = choice.finish_reason or reason
    assert (reasoning, json.loads(args), reason) == (
        CALL["reasoning_content"], {"city": "Paris", "days": 3}, "tool_calls")
    off = client.chat.completions.create(**{**ask, "extra_body": {
        "guided_choice": ["Sunny."], "chat_template_kwargs": {"thinking": False}}})
    assert (off.choices[0].message.content, off.choices[0].message.reasoning) \
        == ("Sunny.", None)


def test_a_grammar_binds_the_answer_after_the_reasoning(mesh, tiny_models):
    """The recipes' default (vLLM's order): the reasoning is free and the grammar binds
    what follows </think>. The model is pushed to close its reasoning at once (a bias on
    V4's </think> token); a grammar binding from the first token would have made the
    JSON the reasoning (no </think> in JSON) and left no content."""
    tok = Tokenizer(tiny_models["deepseek_v4"], mode="deepseek_v4")
    [close] = tok.encode(dsv4.THINK_END, add_special_tokens=False)
    schema = {"type": "object", "required": ["n"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    client = openai.OpenAI(base_url=mesh["gateway"].info["http"] + "/v1", api_key="x",
                           max_retries=0, timeout=120)
    ask = dict(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
               logit_bias={str(close): 100},
               response_format={"type": "json_schema", "json_schema": {
                   "name": "n", "schema": schema}})
    r = client.chat.completions.create(**ask)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", msg
    assert not msg.reasoning and json.loads(msg.content)["n"] in range(10)
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ("", msg.content)
    # thinking off: the answer is bound from its first token
    off = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {
        "thinking": False}})
    assert json.loads(off.choices[0].message.content)["n"] in range(10)


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
# (eight at once, four a rank: with four, a fast box could finish one rank's pair before
# they held their blocks together, and nothing ran out)
HAND_BACK_PROMPTS = [list(range(200 + 31 * i, 236 + 31 * i)) for i in range(8)]
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


def test_a_batch_mixing_three_adapters_and_the_base_matches_peft(mesh, tiny_models, tmp_path):
    """Three adapters on every projection PEFT can target (the compressors' and the
    indexer's among them) loaded at runtime, and the base model, in one batch through
    prefill, the pool and decode: PEFT's tokens over transformers' DeepSeek-V4. (Last:
    the tests above count the pool's traffic.)"""
    import transformers

    transformers.logging.set_verbosity_error()  # (the MTP layers: "unexpected keys")
    got, want = mixed_batch(mesh["gateway"].info["http"], MODEL, tiny_models["deepseek_v4"],
                            "deepseek_v4", tmp_path, stepwise=True)
    assert len({json.dumps(want[k]) for k in (0, 3, 4)}) == 3  # each adapter tells
    assert got == want
