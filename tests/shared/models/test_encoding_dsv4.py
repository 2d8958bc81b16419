"""DeepSeek-V4's chat encoding: the golden prompts (DeepSeek's shipped examples and cases
derived from its reference encoder) render exactly; history reasoning is dropped or kept as
the reference does; tools sit in the system part; the thinking prefix; the refusals.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from pdmesh.shared.models.encoding_dsv4 import (
    ASSISTANT,
    BOS,
    EOS,
    REASONING_EFFORT_MAX,
    SPECIAL_TOKENS,
    THINK_END,
    THINK_START,
    USER,
    encode_messages,
)

GOLDEN = Path(__file__).parent / "golden" / "encoding_dsv4"
CASES = sorted(GOLDEN.glob("*.json"))
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
HISTORY = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "reasoning_content": "greet back", "content": "Hello"},
    {"role": "user", "content": "Weather?"},
]


def _encode(case: dict) -> str:
    return encode_messages(case["messages"], tools=case.get("tools"), thinking=case["thinking"],
                           reasoning_effort=case["reasoning_effort"],
                           add_generation_prompt=case["add_generation_prompt"],
                           continue_final_message=case["continue_final_message"])


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_golden_case_renders_exactly(path: Path):
    case = json.loads(path.read_text(encoding="utf-8"))
    assert _encode(case) == case["expected"]


def test_golden_cases_include_deepseeks_shipped_examples():
    sources = [json.loads(p.read_text(encoding="utf-8"))["source"] for p in CASES]
    assert sum(s.startswith("shipped:") for s in sources) == 4
    assert len(CASES) >= 15


def test_special_tokens_cover_every_marker_in_the_goldens():
    for path in CASES:
        text = json.loads(path.read_text(encoding="utf-8"))["expected"]
        for token in sorted(SPECIAL_TOKENS, key=len, reverse=True):
            text = text.replace(token, "")
        assert "<｜" not in text and "｜>" not in text, path.stem
    assert BOS in SPECIAL_TOKENS and EOS in SPECIAL_TOKENS and "｜DSML｜" in SPECIAL_TOKENS


def test_thinking_without_tools_drops_earlier_reasoning():
    prompt = encode_messages(HISTORY, thinking=True)
    assert "greet back" not in prompt
    assert prompt == (f"{BOS}S{USER}Hi{ASSISTANT}{THINK_END}Hello{EOS}"
                      f"{USER}Weather?{ASSISTANT}{THINK_START}")


def test_thinking_keeps_reasoning_after_the_last_user_message():
    reply = {"role": "assistant", "reasoning_content": "look outside", "content": "Sunny"}
    prompt = encode_messages([*HISTORY, reply], thinking=True)
    assert prompt.endswith(f"{USER}Weather?{ASSISTANT}{THINK_START}look outside{THINK_END}"
                           f"Sunny{EOS}")
    assert "greet back" not in prompt


def test_tools_keep_every_turns_reasoning():
    prompt = encode_messages(HISTORY, tools=TOOLS, thinking=True)
    assert f"{USER}Hi{ASSISTANT}{THINK_START}greet back{THINK_END}Hello{EOS}" in prompt
    assert prompt.endswith(f"{USER}Weather?{ASSISTANT}{THINK_START}")


def test_thinking_drops_a_developer_message_before_the_last_user_message():
    messages = [{"role": "developer", "content": "Be terse."}, *HISTORY[1:]]
    assert "Be terse." not in encode_messages(messages, thinking=True)
    assert "Be terse." in encode_messages(messages, thinking=False)
    assert "Be terse." in encode_messages(messages, tools=TOOLS, thinking=True)


def test_tools_are_rendered_after_the_system_content():
    prompt = encode_messages(HISTORY, tools=TOOLS, thinking=False)
    system_part = prompt[len(BOS):prompt.index(USER)]
    assert system_part.startswith("S\n\n## Tools\n\nYou have access to a set of tools")
    schema = json.dumps(TOOLS[0]["function"], ensure_ascii=False)
    assert f"### Available Tool Schemas\n\n{schema}\n\nYou MUST strictly follow" in system_part
    assert system_part.endswith("to invoke tool calls.\n")


def test_request_tools_replace_the_leading_messages_own():
    own = [{"type": "function", "function": {"name": "old_tool"}}]
    messages = [{**HISTORY[0], "tools": own}, *HISTORY[1:]]
    prompt = encode_messages(messages, tools=TOOLS)
    assert prompt.count("## Tools") == 1 and "old_tool" not in prompt and "get_weather" in prompt


def test_thinking_flag_sets_the_reply_opening():
    messages = [{"role": "user", "content": "Hi"}]
    assert encode_messages(messages, thinking=True) == f"{BOS}{USER}Hi{ASSISTANT}{THINK_START}"
    assert encode_messages(messages, thinking=False) == f"{BOS}{USER}Hi{ASSISTANT}{THINK_END}"


@pytest.mark.parametrize("effort", ["max", "xhigh"])
def test_top_effort_prefixes_thinking_prompts_only(effort: str):
    messages = [{"role": "user", "content": "Hi"}]
    prompt = encode_messages(messages, thinking=True, reasoning_effort=effort)
    assert prompt.startswith(BOS + REASONING_EFFORT_MAX + USER)
    assert REASONING_EFFORT_MAX not in encode_messages(messages, reasoning_effort=effort)


def test_arguments_that_are_not_a_json_object_are_one_string_parameter():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "", "tool_calls": [call]}]
    expected = '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>'
    assert expected in encode_messages(messages)


def test_messages_are_not_changed():
    messages = copy.deepcopy(HISTORY)
    encode_messages(messages, tools=TOOLS, thinking=True)
    assert messages == HISTORY


_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
REFUSED = {
    "unknown role": ([{"role": "narrator", "content": "x"}], {}, "unknown role 'narrator'"),
    "tool without call": ([{"role": "user", "content": "x"},
                           {"role": "tool", "tool_call_id": "c1", "content": "r"}], {},
                          r"messages\[1\]: a tool message with no assistant tool call"),
    "tool after an answer": ([{"role": "user", "content": "x"},
                              {"role": "assistant", "content": "", "tool_calls": [_CALL]},
                              {"role": "tool", "tool_call_id": "c1", "content": "r"},
                              {"role": "assistant", "content": "done"},
                              {"role": "tool", "tool_call_id": "c1", "content": "r"}], {},
                             r"messages\[4\]: a tool message with no assistant tool call"),
    "continue after user": ([{"role": "user", "content": "x"}],
                            {"add_generation_prompt": False, "continue_final_message": True},
                            "continue_final_message: the last message is not the assistant's"),
    "both prompts": ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                     {"continue_final_message": True},
                     "add_generation_prompt and continue_final_message"),
    "bad effort": ([{"role": "user", "content": "x"}], {"reasoning_effort": "extreme"},
                   "reasoning_effort: 'extreme'"),
    "empty developer": ([{"role": "developer", "content": ""}], {},
                        r"messages\[0\]: a developer message needs content"),
    "image part": ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], {},
                   r"messages\[0\]\[0\]: only text parts"),
    "no messages": ([], {}, "messages: expected a non-empty list"),
    "bad tool": ([{"role": "user", "content": "x"}], {"tools": [{"name": "f"}]},
                 r"tools\[0\]: expected"),
    "bad arguments": ([{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": 3}}]}], {},
        r"messages\[0\]\.tool_calls\[0\]\.function\.arguments"),
}


@pytest.mark.parametrize("messages,kwargs,message", REFUSED.values(), ids=REFUSED.keys())
def test_refusals_name_the_problem(messages: list, kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        encode_messages(messages, **kwargs)
