"""Tool calling and reasoning through the PD mesh, with the official openai client (and, at
the end, the client libraries users run: openai-agents, langchain-openai, instructor): one
prefill and one decode instance behind gateways that read the model's output with each
tool-call and reasoning parser. A tiny random model writes no tool calls by itself, so
its output is forced: through a parser's format with guided_choice (the exact text of
a golden case), and for tool_choice "required" / a named function by the grammar the
gateway itself derives from the tools' schemas."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from pdmesh.shared.infra.launcher import Service
from tests.mesh import MODEL, pd_mesh, stop_all

GOLDEN = Path(__file__).parent / "golden" / "parsers"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 10},
                          "unit": {"enum": ["c", "f"]}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["zone"],
         "properties": {"zone": {"enum": ["utc", "cet", "jst"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "the weather in a city"}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
# gateway -> its flags (they share the engines). With a reasoning parser a grammar
# binds only the answer after the reasoning; the tiny model never closes its reasoning by
# itself, so these gateways bind from the first token (vLLM's enable_in_reasoning) and
# force reasoning and answer alike (the default order: test_deepseek_v4_pd.py)
IN_REASONING = ["--structured-outputs-config", '{"enable_in_reasoning": true}']
GATEWAYS = {
    "plain": ["--enable-force-include-usage"],
    "hermes": ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
    "qwen3_coder": ["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
                    "--reasoning-parser", "qwen3", *IN_REASONING],
    "deepseek_v3": ["--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v3",
                    "--reasoning-parser", "deepseek_r1", *IN_REASONING],
    "deepseek_v31": ["--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v31"],
    "deepseek_v4": ["--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v4",
                    "--reasoning-parser", "deepseek_v4", *IN_REASONING],
}
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]


@pytest.fixture(scope="module")
def gateways(qwen3_path, tmp_path_factory, registry_prefix):
    prefix = registry_prefix + "-tools"
    logs = tmp_path_factory.mktemp("tools-logs")
    with pd_mesh(qwen3_path, logs, prefix, gateway_args=GATEWAYS["hermes"]) as mesh:
        started: list[Service] = []
        try:
            others = {name: Service("gateway", ["gateway", str(qwen3_path), "--port", "0",
                                                "--served-model-name", MODEL, *flags,
                                                "--registry-prefix", prefix], logs, wait=False)
                      for name, flags in GATEWAYS.items() if name != "hermes"}
            started += others.values()
            urls = {"hermes": mesh["gateway"].info["http"]}
            for name, gw in others.items():  # (started side by side)
                gw.wait_ready()
                urls[name] = gw.info["http"]
            yield urls
        finally:
            stop_all(started)


def client(gateways, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateways[name] + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def golden(parser: str) -> list[dict]:
    return [c for c in json.loads((GOLDEN / f"{parser}.json").read_text())
            if c.get("calls")]


def streamed(stream) -> tuple[str, dict[int, dict], str | None, str]:
    """(content, calls by index {id, name, arguments}, finish_reason, reasoning) of a
    chat stream, checking vLLM's delta shapes on the way."""
    content, reasoning, calls, reason = "", "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning", None) or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:  # the first delta of a call: id, type and name
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = {"id": tc.id, "name": tc.function.name,
                                   "arguments": tc.function.arguments or ""}
            else:  # then its arguments, as fragments
                assert tc.id is None and not tc.function.name, tc
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content, calls, reason, reasoning


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder", "deepseek_v3", "deepseek_v31",
                                    "deepseek_v4"])
def test_auto_tool_calls_are_parsed_whole_and_streamed(gateways, parser):
    c = client(gateways, parser)
    off = {"chat_template_kwargs": {"enable_thinking": False, "thinking": False}}
    for case in golden(parser)[:2]:
        force = {"guided_choice": [case["text"]], **off}
        r = c.chat.completions.create(model=MODEL, messages=ASK, tools=case.get("tools") or TOOLS,
                                      max_tokens=400, temperature=0, extra_body=force)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", msg
        got = [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls]
        assert got == [(k["name"], k["arguments"]) for k in case["calls"]], case["name"]
        assert (msg.content or None) == case["content"]
        assert len({t.id for t in msg.tool_calls}) == len(msg.tool_calls)
        content, calls, reason, _ = streamed(c.chat.completions.create(
            model=MODEL, messages=ASK, tools=case.get("tools") or TOOLS, max_tokens=400,
            temperature=0, stream=True, extra_body=force))
        assert reason == "tool_calls"
        assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] \
            == got
        assert (content or None) == case["content"]


def test_tool_choice_none_leaves_call_markup_as_content(gateways):
    text = golden("hermes")[0]["text"]
    r = client(gateways, "hermes").chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=300,
        temperature=0, extra_body={"guided_choice": [text]})
    assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_calls_a_tool_with_valid_arguments(gateways, parallel, qwen3_path):
    """No parser needed: the gateway's own grammar (a JSON list of {name, parameters})
    forces the calls, on a gateway without --enable-auto-tool-choice too. (A random model
    would list calls forever: a bias towards "]" lets it end the list.)"""
    from pdmesh.shared.models.tokenizer import Tokenizer

    vocab = Tokenizer(qwen3_path)._tok.get_vocab()
    ends = {str(i): 6.0 for t, i in vocab.items() if t.endswith("]")}
    c = client(gateways, "plain")
    for seed in (1, 2, 3):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                  max_tokens=300, temperature=1.0, seed=seed, parallel_tool_calls=parallel,
                  logit_bias=ends)
        r = c.chat.completions.create(**kw)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls
        assert parallel or len(calls) == 1
        for t in calls:
            jsonschema.validate(json.loads(t.function.arguments), SCHEMAS[t.function.name])
        _, streamed_calls, reason, _ = streamed(c.chat.completions.create(**kw, stream=True))
        assert reason == "tool_calls"
        assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(
            streamed_calls.items())] == [(t.function.name, json.loads(t.function.arguments))
                                         for t in calls]


def test_a_named_tool_choice_calls_that_tool(gateways):
    c = client(gateways, "plain")
    choice = {"type": "function", "function": {"name": "get_time"}}
    for seed in (4, 5):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=60,
                  temperature=1.0, seed=seed)
        r = c.chat.completions.create(**kw)
        [call] = r.choices[0].message.tool_calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), CLOCK)
        _, calls, _, _ = streamed(c.chat.completions.create(**kw, stream=True))
        assert calls[0]["name"] == "get_time"
        assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)


def test_auto_without_the_flags_is_refused_as_vllm_does(gateways):
    r = httpx.post(gateways["plain"] + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": ASK, "tools": TOOLS})
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "tool_choice"
    r = httpx.post(gateways["plain"] + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": ASK, "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]


def test_tools_and_their_results_reach_the_chat_template(gateways):
    """The tools are rendered into the prompt; an assistant's earlier calls and the
    tool's answer go back into the history."""
    c = client(gateways, "hermes")
    bare = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                     tool_choice="none")
    with_tools = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           tool_choice="none", max_tokens=1)
    assert with_tools.usage.prompt_tokens > bare.usage.prompt_tokens + 50
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    r = c.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=2,
                                  tool_choice="none")
    assert r.usage.prompt_tokens > with_tools.usage.prompt_tokens + 10


@pytest.mark.parametrize("gateway,parser", [("qwen3_coder", "qwen3"),
                                            ("deepseek_v3", "deepseek_r1"),
                                            ("deepseek_v4", "deepseek_v4")])
def test_reasoning_is_split_from_the_answer(gateways, gateway, parser):
    cases = [k for k in json.loads((GOLDEN / f"reasoning_{parser}.json").read_text())
             if k.get("thinking", True) and k.get("reasoning") and k.get("content")]
    c = client(gateways, gateway)
    on = {"chat_template_kwargs": {"thinking": True, "enable_thinking": True}}
    for case in cases[:2]:
        force = {"guided_choice": [case["text"]], **on}
        r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=300,
                                      temperature=0, extra_body=force)
        msg = r.choices[0].message
        assert (msg.reasoning, msg.content) == (case["reasoning"], case["content"])
        # its tokens counted (vLLM's usage detail): some, fewer than the answer's
        counted = r.usage.completion_tokens_details.reasoning_tokens
        assert 0 < counted < r.usage.completion_tokens, r.usage
        content, _, _, reasoning = streamed(c.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=300, temperature=0, stream=True,
            extra_body=force))
        assert (reasoning, content) == (case["reasoning"], case["content"])
    off = {"guided_choice": [cases[0]["text"]],
           "chat_template_kwargs": {"thinking": False, "enable_thinking": False}}
    r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=300, temperature=0,
                                  extra_body=off)
    assert r.choices[0].message.content == cases[0]["text"]  # thinking off: all content
    assert not r.choices[0].message.reasoning
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_responses_api_text_reasoning_and_function_calls(gateways):
    """/v1/responses with the official client: a reasoning item and a message, whole and
    streamed as the Responses events; a forced function call as a function_call item;
    earlier calls and their outputs as input items."""
    c = client(gateways, "qwen3_coder")  # (--reasoning-parser qwen3)
    text = "<think>\nshort\n</think>\n\nHello there"
    force = {"guided_choice": [text], "chat_template_kwargs": {"enable_thinking": True}}
    r = c.responses.create(model=MODEL, input="hi", instructions="be brief",
                           max_output_tokens=200, temperature=0, extra_body=force)
    assert r.status == "completed" and [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "\nshort\n" and r.output_text == "\n\nHello there"
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    kinds, deltas, done = [], "", None
    for event in c.responses.create(model=MODEL, input="hi", max_output_tokens=200,
                                    temperature=0, stream=True, extra_body=force):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas += event.delta
        if event.type == "response.completed":
            done = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_item.done" in kinds
    assert deltas == "\n\nHello there" and done.output_text == deltas
    assert [e for e in kinds if e.startswith("response.reasoning_text")]
    tools = [{"type": "function", "name": "get_time", "parameters": CLOCK}]
    r = c.responses.create(model=MODEL, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "time?"}]},
        {"type": "function_call", "call_id": "c0", "name": "get_time",
         "arguments": '{"zone": "utc"}'},
        {"type": "function_call_output", "call_id": "c0", "output": "12:00"}],
        tools=tools, tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=40, temperature=1.0)
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_time" and call.call_id
    jsonschema.validate(json.loads(call.arguments), CLOCK)


def test_responses_api_refuses_what_it_cannot_serve(gateways):
    url = gateways["plain"] + "/v1/responses"
    for body, needle in (({"model": MODEL, "input": "x", "previous_response_id": "r1"},
                          "previous_response_id"),
                         ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]},
                          "tools.0.type"),
                         ({"model": MODEL, "input": [{"type": "image_generation_call"}]},
                          "input.0.type"),
                         ({"model": MODEL}, "input"),
                         ({"model": "nope", "input": "x"}, "model")):
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code in (400, 404) and needle in r.json()["error"]["message"], r.text


def test_a_grammar_with_a_reasoning_parser_answers_content(gateways, qwen3_path):
    """The grammar holds from the first token, so an output that never closes a
    reasoning block is the answer, not reasoning (Qwen3 thinks by default)."""
    from pdmesh.shared.models.tokenizer import Tokenizer

    close = Tokenizer(qwen3_path).encode("}", add_special_tokens=False)
    c = client(gateways, "qwen3_coder")  # (--reasoning-parser qwen3)
    kw = dict(model=MODEL, messages=ASK, max_tokens=30, temperature=0,
              response_format={"type": "json_object"}, logit_bias={str(close[0]): 50})
    r = c.chat.completions.create(**kw)
    assert json.loads(r.choices[0].message.content) == {}
    assert not r.choices[0].message.reasoning
    content, _, _, reasoning = streamed(c.chat.completions.create(**kw, stream=True))
    assert content == r.choices[0].message.content and not reasoning


def test_the_end_of_sequence_is_not_text_with_kept_special_tokens(gateways, qwen3_path):
    """hermes keeps special tokens in the text (its markers): the stop token itself is
    still not part of the answer."""
    from pdmesh.shared.models.tokenizer import Tokenizer

    eos = Tokenizer(qwen3_path).eos_token_id
    r = client(gateways, "hermes").chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=5, temperature=0,
        logit_bias={str(eos): 100})
    assert r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.content and not r.choices[0].message.tool_calls


# -- the client libraries our users run: the official openai SDK, openai-agents,
# langchain-openai and instructor (a forced tool call, a structured output and a stream
# each) against the hermes gateway; every schema bounded (enums, short strings, no other
# keys) so the random model's forced answer fits its token budget

SDK_ASK = "what is the weather in Paris?"


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")  # (no other keys: the answer stays short)

    city: Literal["Paris", "Rome", "Oslo"]
    unit: Literal["c", "f"]
    note: str = Field(max_length=8)


SDK_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "unit"],
                   "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                  "unit": {"enum": ["c", "f"]}}}}}


@pytest.fixture(scope="module")
def url(gateways):
    return gateways["hermes"] + "/v1"


def test_openai_parse_and_a_named_tool_stream(url):
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
    parsed = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": SDK_ASK}], response_format=Weather,
        max_tokens=64, temperature=0).choices[0].message.parsed
    assert isinstance(parsed, Weather)
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": SDK_ASK}], tools=[SDK_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=64, temperature=0, stream=True):
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            seen = calls.setdefault(call.index, {"name": "", "arguments": ""})
            seen["name"] += call.function.name or ""
            seen["arguments"] += call.function.arguments or ""
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    args = json.loads(calls[0]["arguments"])
    assert args["city"] in ("Paris", "Rome", "Oslo") and args["unit"] in ("c", "f")


def test_langchain_bind_tools_structured_output_and_stream(url):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=url, api_key="none", temperature=0,
                     max_tokens=64, max_retries=0, timeout=60)
    msg = llm.bind_tools([SDK_TOOL], tool_choice="get_weather").invoke(SDK_ASK)
    [call] = msg.tool_calls
    assert call["name"] == "get_weather" and call["args"]["unit"] in ("c", "f")
    chunks = list(llm.bind_tools([SDK_TOOL], tool_choice="get_weather").stream(SDK_ASK))
    whole = chunks[0]
    for c in chunks[1:]:
        whole += c
    assert [c["name"] for c in whole.tool_calls] == ["get_weather"]
    assert whole.tool_calls[0]["args"] == call["args"]  # (greedy: the same call)
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Weather, method=method).invoke(SDK_ASK)
        assert isinstance(out, Weather), method
    short = ChatOpenAI(model=MODEL, base_url=url, api_key="none", temperature=0,
                       max_tokens=8, max_retries=0, timeout=60,
                       extra_body={"ignore_eos": True})
    streamed = "".join(c.content for c in short.stream(SDK_ASK))
    assert streamed and streamed == short.invoke(SDK_ASK).content


def test_instructor_response_model(url):
    import instructor

    client = instructor.from_openai(openai.OpenAI(base_url=url, api_key="none",
                                                  max_retries=0, timeout=60))
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client.mode = mode
        out = client.chat.completions.create(
            model=MODEL, response_model=Weather, messages=[{"role": "user", "content": SDK_ASK}],
            max_tokens=64, temperature=0, max_retries=1)
        assert isinstance(out, Weather), mode


def test_openai_agents_run_a_tool_and_a_structured_answer(url):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # (its traces would go to OpenAI's servers)
    asked: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"], unit: Literal["c", "f"]) -> str:
        """The weather in a city."""
        asked.append((city, unit))
        return f"18 {unit} in {city}"

    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=url, api_key="none", max_retries=0, timeout=60))
    agent = Agent(name="weather", instructions="Answer with the tool.", model=model,
                  tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="get_weather", max_tokens=64,
                                               temperature=0))
    result = Runner.run_sync(agent, SDK_ASK, max_turns=2)
    assert len(asked) == 1 and result.final_output == f"18 {asked[0][1]} in {asked[0][0]}"
    structured = Agent(name="structured", instructions="Answer as asked.", model=model,
                       output_type=Weather,
                       model_settings=ModelSettings(max_tokens=64, temperature=0))
    assert isinstance(Runner.run_sync(structured, SDK_ASK, max_turns=1).final_output, Weather)


def test_every_stream_ends_with_usage_when_forced(gateways):
    """--enable-force-include-usage (vLLM's): a usage chunk ends every stream, asked for
    or not; without it, only when stream_options asks."""
    for name, want in (("plain", True), ("hermes", False)):
        chunks = list(client(gateways, name).chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=3, temperature=0, stream=True))
        usage = [c.usage for c in chunks if c.usage is not None]
        assert bool(usage) == want, name
        if want:
            assert not chunks[-1].choices and usage[-1].completion_tokens == 3


def test_answers_have_vllm_s_shapes(gateways, tmp_path):
    """The differential harness (scripts/vllm_diff.py) against vLLM 0.32's answers to the
    same ~60 requests, recorded with vLLM-CPU serving the same tiny model (seed 0,
    float32, the hermes parser): status, fields at every level (streams' chunks too),
    finish reasons, usage and greedy text; only the documented differences may remain."""
    root = Path(__file__).resolve().parents[3]
    run = subprocess.run(
        [sys.executable, str(root / "scripts" / "vllm_diff.py"), "--pdmesh",
         gateways["hermes"], "--golden", str(Path(__file__).parent / "golden" /
                                             "vllm_shapes.json"),
         "--model", MODEL, "--report", str(tmp_path / "report.json")],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 differ otherwise" in run.stdout
