"""Tool-call and reasoning parsers against golden outputs (golden/parsers/*.json): the
whole-output parse is the expected one, and streaming the same text split anywhere gives
the same content and calls, in OpenAI's delta shapes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pdmesh.services.gateway.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    reasoning_parser,
    thinking_enabled,
    tool_parser,
)
from pdmesh.services.gateway.protocol import ChatCompletionRequest, chat_kwargs

GOLDEN = Path(__file__).parent / "golden" / "parsers"


def _load(reasoning: bool) -> list[dict]:
    cases = []
    for path in sorted(GOLDEN.glob("*.json")):
        if path.name.startswith("reasoning_") == reasoning:
            cases += json.loads(path.read_text())
    return cases


TOOL_CASES = _load(reasoning=False)
REASONING_CASES = _load(reasoning=True)
STREAMED = [c for c in TOOL_CASES if c["stream"] is not None]


def _id(case: dict) -> str:
    return f"{case['parser']}: {case['name']}"


def _pieces(text: str, rng: random.Random | None) -> list[str]:
    """``text`` one character at a time, or at random split points."""
    if rng is None:
        return list(text)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _stream_tools(case: dict, pieces: list[str]) -> tuple[list[dict], object]:
    parser = tool_parser(case["parser"], case.get("tools"))
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
    return deltas, parser


def _assemble(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str, str]]]:
    """Content and (id, name, arguments) per call, checking each delta's shape."""
    content, calls = "", {}
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"}), delta
        if "content" in delta:
            assert delta["content"] and not calls, "content is only what precedes the calls"
            content += delta["content"]
            continue
        (call,) = delta["tool_calls"]
        index = call["index"]
        if index not in calls:  # a call's first delta: id, type and name, no arguments
            assert index == len(calls), "calls are numbered 0, 1, ..."
            assert set(call) == {"index", "id", "type", "function"}, call
            assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
            assert call["function"]["arguments"] == ""
            calls[index] = [call["id"], call["function"]["name"], ""]
        else:
            assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
            assert index == len(calls) - 1, "a call's fragments come before the next call"
            assert call["function"]["arguments"]
            calls[index][2] += call["function"]["arguments"]
    return content or None, [tuple(c) for c in calls.values()]


# -- tool calls --------------------------------------------------------------------------
@pytest.mark.parametrize("case", TOOL_CASES, ids=_id)
def test_extract_matches_golden(case: dict) -> None:
    content, calls = tool_parser(case["parser"], case.get("tools")).extract(case["text"])
    assert content == case["content"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [(c["name"], c["arguments"]) for c in case["calls"]]
    assert all(c.id.startswith("chatcmpl-tool-") for c in calls)
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("seed", [None, 0, 1, 2, 3, 4], ids=lambda s: f"split-{s}")
@pytest.mark.parametrize("case", STREAMED, ids=_id)
def test_stream_matches_extract(case: dict, seed: int | None) -> None:
    rng = None if seed is None else random.Random(seed)
    deltas, parser = _stream_tools(case, _pieces(case["text"], rng))
    content, calls = _assemble(deltas)
    want_content, want_calls = tool_parser(case["parser"], case.get("tools")).extract(
        case["text"])
    assert content == want_content == case["stream"]["content"]
    assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in want_calls]
    assert [n for _, n, _ in calls] == case["stream"]["call_names"]
    assert [json.loads(a) for _, _, a in calls] == [c["arguments"] for c in case["calls"]]
    assert [(c.id, c.name, c.arguments) for c in parser.calls] == calls


@pytest.mark.parametrize("case", [c for c in TOOL_CASES if c["stream"] is None], ids=_id)
def test_stream_of_a_call_that_does_not_parse(case: dict) -> None:
    """Its header went out before it broke, so the stream reports a call that extract
    gives back as content (as vLLM, which cannot take a sent delta back either)."""
    deltas, parser = _stream_tools(case, list(case["text"]))
    content, calls = _assemble(deltas)
    assert calls and parser.calls
    assert case["text"].startswith(content or "")


def test_arguments_stream_before_the_call_ends() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"a": "' + "x" * 50 + '"}}\n</tool_call>'
    parser = tool_parser("hermes", None)
    deltas = [d for ch in text[:-20] for d in parser.feed(ch)]
    fragments = [d for d in deltas if "arguments" in d["tool_calls"][0]["function"]]
    assert len(fragments) > 10


def test_llama3_streams_the_name_then_argument_fragments() -> None:
    text = '<|python_tag|>{"name": "f", "parameters": {"a": "' + "x" * 50 + '"}}'
    parser = tool_parser("llama3_json", None)
    deltas = [d for ch in text[:-5] for d in parser.feed(ch)]
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert len(deltas) > 10 and all("tool_calls" in d for d in deltas)


def test_llama3_braces_in_prose_stream_on() -> None:
    parser = tool_parser("llama3_json", None)
    assert parser.feed("A set: {1, ") == [{"content": "A set: "}, {"content": "{1, "}]
    assert parser.feed('2}; {"a"') == [{"content": '2}; {"a"'}]


def test_partial_marker_is_held_then_released() -> None:
    parser = tool_parser("hermes", None)
    assert parser.feed("Hello <tool_") == [{"content": "Hello "}]
    assert parser.finish() == [{"content": "<tool_"}]
    assert parser.calls == []


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="'nope'.*deepseek_v3.*hermes.*qwen3_coder"):
        tool_parser("nope", None)
    with pytest.raises(ValueError, match="'nope'.*deepseek_r1.*qwen3"):
        reasoning_parser("nope")


def test_registries_and_special_tokens() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "qwen3_coder", "deepseek_v3", "deepseek_v31",
                                 "deepseek_v4", "llama3_json", "llama3"}
    assert TOOL_PARSERS["llama3"] is TOOL_PARSERS["llama3_json"]  # SGLang's name for it
    assert set(REASONING_PARSERS) == {"deepseek_r1", "deepseek_v3", "qwen3", "deepseek_v4",
                                      "glm45", "kimi", "step3"}
    assert {n for n, p in TOOL_PARSERS.items() if p.needs_special_tokens} == \
        {"hermes", "deepseek_v4"}


def test_every_parser_has_four_golden_cases() -> None:
    for name, parser in TOOL_PARSERS.items():  # an alias counts its format's cases
        assert sum(TOOL_PARSERS[c["parser"]] is parser for c in TOOL_CASES) >= 4, name
    for name in REASONING_PARSERS:
        assert sum(c["parser"] == name for c in REASONING_CASES) >= 4, name


# -- reasoning ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", REASONING_CASES, ids=_id)
def test_reasoning_extract_matches_golden(case: dict) -> None:
    parser = reasoning_parser(case["parser"], case["thinking"])
    assert parser.extract(case["text"]) == (case["reasoning"], case["content"])


@pytest.mark.parametrize("seed", [None, 0, 1, 2, 3, 4], ids=lambda s: f"split-{s}")
@pytest.mark.parametrize("case", REASONING_CASES, ids=_id)
def test_reasoning_stream_matches_extract(case: dict, seed: int | None) -> None:
    rng = None if seed is None else random.Random(seed)
    parser = reasoning_parser(case["parser"], case["thinking"])
    reasoning = content = ""
    for piece in [*_pieces(case["text"], rng), None]:
        got = parser.finish() if piece is None else parser.feed(piece)
        assert content == "" or got[0] == "", "no reasoning after content began"
        reasoning, content = reasoning + got[0], content + got[1]
    assert (reasoning or None, content or None) == (case["reasoning"], case["content"])


def test_thinking_switch_from_chat_template_kwargs() -> None:
    assert thinking_enabled("qwen3", None)
    assert not thinking_enabled("qwen3", {"enable_thinking": False})
    assert not thinking_enabled("deepseek_v4", {"thinking": False})
    assert thinking_enabled("deepseek_v4", {"thinking": True})
    assert thinking_enabled("deepseek_v4", {})  # vLLM 0.32's deepseek_v4 default
    # reasoning_effort "none" is thinking off, as DeepSeek-V4's encoding reads it; the
    # request's reasoning_effort wins over its chat template kwargs' and switches
    # enable_thinking unless they set it (vLLM's merge)
    assert not thinking_enabled("qwen3", {"reasoning_effort": "none", "thinking": True})
    assert thinking_enabled("deepseek_v4", {"reasoning_effort": "high", "thinking": True})

    def kwargs(effort: str, given: dict) -> dict:
        return chat_kwargs(ChatCompletionRequest.model_validate({
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "reasoning_effort": effort, "chat_template_kwargs": given}))

    assert kwargs("high", {"reasoning_effort": "none"}) == {
        "reasoning_effort": "high", "enable_thinking": True}
    assert thinking_enabled("qwen3", kwargs("high", {"reasoning_effort": "none"}))
    assert kwargs("none", {}) == {"reasoning_effort": "none", "enable_thinking": False}
    assert not thinking_enabled("deepseek_v4", kwargs("none", {}))
    assert kwargs("low", {"enable_thinking": False})["enable_thinking"] is False
    assert reasoning_parser("deepseek_v4", thinking=False).extract("a</think>b") == \
        (None, "a</think>b")


@pytest.mark.parametrize(("parser", "tools", "text"), [
    ("qwen3_coder", [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "any"}, "y": {"type": "number"}}}}}],
     "<tool_call>\n<function=f>\n<parameter=x>\n{1, 2}\n</parameter>\n<parameter=y>\n1e999\n"
     "</parameter>\n</function>\n</tool_call>"),
    ("hermes", None, '<tool_call>\n{"name": "f", "arguments": {"s": "\\uZZZZ"}}\n</tool_call>'),
    ("hermes", None, '<tool_call>\n{"name": "f", "arguments": {"s": "a\\ud800b"}}\n</tool_call>'),
])
def test_odd_model_output_never_breaks_the_answer(parser, tools, text):
    """Values JSON cannot hold stay text, broken escapes stay content, lone surrogates
    stay escaped: whatever the model writes, the answer is valid UTF-8 JSON."""
    import json

    content, calls = tool_parser(parser, tools).extract(text)
    for call in calls:
        json.loads(call.arguments)
        call.arguments.encode("utf-8")
    streaming = tool_parser(parser, tools)
    parts = [d for ch in text for d in streaming.feed(ch)] + streaming.finish()
    json.dumps(parts, allow_nan=False).encode("utf-8")
    assert calls or content == text
