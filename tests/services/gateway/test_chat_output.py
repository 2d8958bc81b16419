"""A chat answer's shaping (ChatOutput) without a mesh: where a grammar starts to bind,
parallel_tool_calls false in a stream, a forced call after the reasoning."""

from __future__ import annotations

import json

from pdmesh.services.gateway.chat_output import ChatOutput, OutputSettings
from pdmesh.services.gateway.protocol import ChatCompletionRequest

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}} for name in ("f", "g")]
TWO_CALLS = ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
             '<tool_call>\n{"name": "g", "arguments": {"x": 2}}\n</tool_call>')


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def streamed(output: ChatOutput, text: str) -> list[dict]:
    deltas = [d for ch in text for d in output.feed(ch)]
    return deltas + output.finish()


def test_a_stream_without_parallel_calls_sends_the_first_call_only():
    hermes = OutputSettings(tool_call_parser="hermes", auto_tool_choice=True)
    for parallel, names in ((True, ["f", "g"]), (False, ["f"])):
        deltas = streamed(ChatOutput(request(tools=TOOLS, parallel_tool_calls=parallel),
                                     hermes), TWO_CALLS)
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [c["function"]["name"] for c in calls if c.get("id")] == names
        assert {c["index"] for c in calls} == set(range(len(names)))
        assert all(d for d in deltas)  # no empty delta left where a call was dropped
        whole = ChatOutput(request(tools=TOOLS, parallel_tool_calls=parallel), hermes)
        assert [c["function"]["name"] for c in whole.message(TWO_CALLS)["tool_calls"]] == names


def test_a_grammar_binds_after_the_reasoning_unless_told_otherwise():
    qwen3 = OutputSettings(reasoning_parser="qwen3")
    thinking = ChatOutput(request(), qwen3)
    assert thinking.thinks and thinking.grammar_after() == "</think>"
    off = ChatOutput(request(chat_template_kwargs={"enable_thinking": False}), qwen3)
    assert off.grammar_after() is None  # no reasoning: from the first token
    assert ChatOutput(request(), OutputSettings()).grammar_after() is None
    first = ChatOutput(request(), OutputSettings(reasoning_parser="qwen3",
                                                 grammar_in_reasoning=True))
    assert first.thinks and first.grammar_after() is None
    # bound from the first token (constrained): the output is the answer unless it
    # closes a reasoning itself
    first.constrained = True
    assert first.message('{"a": 1}')["content"] == '{"a": 1}'


def test_a_forced_call_follows_the_reasoning():
    qwen3 = OutputSettings(reasoning_parser="qwen3")
    named = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}})
    text = '<think>\nwhich tool?\n</think>\n\n{"x": 7}'
    msg = ChatOutput(named, qwen3).message(text)
    assert msg["reasoning"] == "\nwhich tool?\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["tool_calls"]] == [("g", {"x": 7})]
    deltas = streamed(ChatOutput(named, qwen3), text)
    assert "".join(d.get("reasoning", "") for d in deltas) == "\nwhich tool?\n"
    args = "".join(c["function"].get("arguments", "") for d in deltas
                   for c in d.get("tool_calls", []))
    assert json.loads(args) == {"x": 7}


def test_a_named_call_cut_off_in_its_reasoning_is_no_call():
    """The token limit came while the model still thought: no call made up with {}
    arguments (vLLM returns none), whole or streamed."""
    qwen3 = OutputSettings(reasoning_parser="qwen3")
    named = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}})
    text = "<think>\nwhich tool shall I"
    msg = ChatOutput(named, qwen3).message(text)
    assert "tool_calls" not in msg and msg["reasoning"] == "\nwhich tool shall I"
    deltas = streamed(ChatOutput(named, qwen3), text)
    assert not [d for d in deltas if "tool_calls" in d]
    assert "".join(d.get("reasoning", "") for d in deltas) == "\nwhich tool shall I"


def test_reasoning_tokens_are_counted_up_to_the_end_of_the_reasoning():
    """Each token's text, in order: the markers are not reasoning, nor is the answer."""
    qwen3 = OutputSettings(reasoning_parser="qwen3")
    pieces = [(p, 1) for p in ("<think>", "\n", "which", " tool", "?", "\n", "</think>",
                               "\n\n", "It", " is")]
    for split in (1, 3, len(pieces)):  # deltas of one token, three, all at once
        out = ChatOutput(request(), qwen3)
        for i in range(0, len(pieces), split):
            if out.counting:
                out.count(pieces[i:i + split])
        assert out.reasoning_tokens == 5 and not out.counting
        assert out.usage_details == {"reasoning_tokens": 5}
    no_open = ChatOutput(request(), qwen3)  # (the template opened it: none generated)
    no_open.count([("天", 3), *pieces[1:]])  # (a character of three tokens)
    assert no_open.reasoning_tokens == 8
    off = ChatOutput(request(chat_template_kwargs={"enable_thinking": False}), qwen3)
    assert not off.counting and off.usage_details == {"reasoning_tokens": 0}
    assert ChatOutput(request(), OutputSettings()).usage_details is None  # no parser


def test_include_reasoning_false_leaves_the_reasoning_out():
    """vLLM's include_reasoning: false drops the reasoning, whole and streamed (still
    counted in usage), and a grammar binds from the first token."""
    qwen3 = OutputSettings(reasoning_parser="qwen3")
    text = "<think>\nwhich tool?\n</think>\n\nIt is"
    shown, hidden = ChatOutput(request(), qwen3), ChatOutput(
        request(include_reasoning=False), qwen3)
    assert shown.message(text)["reasoning"] == "\nwhich tool?\n"
    msg = hidden.message(text)
    assert msg["reasoning"] is None and msg["content"] == "\n\nIt is"
    deltas = streamed(ChatOutput(request(include_reasoning=False), qwen3), text)
    assert not [d for d in deltas if d.get("reasoning")]
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nIt is"
    assert shown.grammar_after() == "</think>" and hidden.grammar_after() is None
    assert hidden.hides_reasoning and not ChatOutput(  # (no parser: nothing to hide)
        request(include_reasoning=False), OutputSettings()).hides_reasoning
