"""The client libraries our users run against the PD mesh: the official openai SDK,
openai-agents, langchain-openai and instructor - a forced tool call, a structured
output and a stream each, through one prefill and one decode instance behind a gateway
that reads hermes tool calls. The tiny random model writes what the grammar the gateway
derives from each schema allows, so every schema is bounded (enums, short strings) and
every answer fits its token budget."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.mesh import MODEL, pd_mesh

HERMES = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
ASK = "what is the weather in Paris?"


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")  # (no other keys: the answer stays short)

    city: Literal["Paris", "Rome", "Oslo"]
    unit: Literal["c", "f"]
    note: str = Field(max_length=8)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "unit"],
                   "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                  "unit": {"enum": ["c", "f"]}}}}}


@pytest.fixture(scope="module")
def url(qwen3_path, tmp_path_factory, registry_prefix):
    with pd_mesh(qwen3_path, tmp_path_factory.mktemp("sdk-logs"), registry_prefix + "-sdk",
                 gateway_args=HERMES) as services:
        yield services["gateway"].info["http"] + "/v1"


def test_openai_parse_and_a_named_tool_stream(url):
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
    parsed = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": ASK}], response_format=Weather,
        max_tokens=64, temperature=0).choices[0].message.parsed
    assert isinstance(parsed, Weather)
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[WEATHER_TOOL],
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
    msg = llm.bind_tools([WEATHER_TOOL], tool_choice="get_weather").invoke(ASK)
    [call] = msg.tool_calls
    assert call["name"] == "get_weather" and call["args"]["unit"] in ("c", "f")
    chunks = list(llm.bind_tools([WEATHER_TOOL], tool_choice="get_weather").stream(ASK))
    whole = chunks[0]
    for c in chunks[1:]:
        whole += c
    assert [c["name"] for c in whole.tool_calls] == ["get_weather"]
    assert whole.tool_calls[0]["args"] == call["args"]  # (greedy: the same call)
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Weather, method=method).invoke(ASK)
        assert isinstance(out, Weather), method
    short = ChatOpenAI(model=MODEL, base_url=url, api_key="none", temperature=0,
                       max_tokens=8, max_retries=0, timeout=60,
                       extra_body={"ignore_eos": True})
    streamed = "".join(c.content for c in short.stream(ASK))
    assert streamed and streamed == short.invoke(ASK).content


def test_instructor_response_model(url):
    import instructor

    client = instructor.from_openai(openai.OpenAI(base_url=url, api_key="none",
                                                  max_retries=0, timeout=60))
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client.mode = mode
        out = client.chat.completions.create(
            model=MODEL, response_model=Weather, messages=[{"role": "user", "content": ASK}],
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
    result = Runner.run_sync(agent, ASK, max_turns=2)
    assert len(asked) == 1 and result.final_output == f"18 {asked[0][1]} in {asked[0][0]}"
    structured = Agent(name="structured", instructions="Answer as asked.", model=model,
                       output_type=Weather,
                       model_settings=ModelSettings(max_tokens=64, temperature=0))
    assert isinstance(Runner.run_sync(structured, ASK, max_turns=1).final_output, Weather)
