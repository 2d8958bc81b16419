"""What a chat answer's text becomes: ``reasoning``, ``content`` and ``tool_calls``, whole
or as the deltas of a stream, as vLLM's chat server shapes them (vLLM 0.32 names the
reasoning ``reasoning``; earlier ones, SGLang and DeepSeek's API ``reasoning_content``).

    text ──reasoning parser (--reasoning-parser)──▶ reasoning
                    └──▶ the rest ──tool_choice──▶ auto: the tool-call parser's content and
                                                   calls (--tool-call-parser)
                                                   required: a JSON list of {name,
                                                   parameters} (forced by a grammar)
                                                   a named function: its arguments (forced)
                                                   none: content

In a stream a call arrives as vLLM sends one: its index, id, type and name first, then
its arguments as JSON fragments; a ``required`` list is sent call by call once complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdmesh.services.gateway.parsers import (
    ReasoningParser,
    ToolCall,
    ToolParser,
    reasoning_parser,
    thinking_enabled,
    tool_parser,
)
from pdmesh.services.gateway.parsers.tools import call_id
from pdmesh.services.gateway.protocol import ChatCompletionRequest, NamedToolChoice, chat_kwargs
from pdmesh.shared.engine.structured import json_schema_grammar


@dataclass(frozen=True)
class OutputSettings:
    """The gateway's flags for what it reads out of a chat answer."""

    tool_call_parser: str | None = None
    auto_tool_choice: bool = False  # --enable-auto-tool-choice
    reasoning_parser: str | None = None
    # --structured-outputs-config's enable_in_reasoning: a grammar binds the reasoning
    # too (default: only the answer after it, as vLLM)
    grammar_in_reasoning: bool = False


class ChatOutput:
    """One chat request's answer shaping (it holds the stream's parser state)."""

    def __init__(self, body: ChatCompletionRequest, settings: OutputSettings):
        choice = body.effective_tool_choice()
        if choice == "auto" and body.tools and not (settings.auto_tool_choice
                                                    and settings.tool_call_parser):
            raise ValueError('tool_choice: "auto" tool choice requires '
                             '--enable-auto-tool-choice and --tool-call-parser to be set')
        tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
        self.mode = (choice.function.name if isinstance(choice, NamedToolChoice)
                     else choice if body.tools else "none")
        self.parallel = body.parallel_tool_calls
        self.tools: ToolParser | None = None
        if self.mode == "auto":
            assert settings.tool_call_parser is not None
            self.tools = tool_parser(settings.tool_call_parser, tools)
        self.reasoning: ReasoningParser | None = None
        if settings.reasoning_parser:
            # (read as the chat template reads it: see thinking_asked)
            thinking = thinking_enabled(settings.reasoning_parser, chat_kwargs(body))
            self.reasoning = reasoning_parser(settings.reasoning_parser, thinking)
        # include_reasoning false: a grammar binds from the first token, as vLLM's
        self.grammar_in_reasoning = settings.grammar_in_reasoning or not body.include_reasoning
        # ... and the reasoning is left out, with what would show it (vLLM's)
        self.hides_reasoning = self.reasoning is not None and not body.include_reasoning
        # a grammar (response_format, guided_*, a forced call) that binds from the first
        # token of a thinking answer: it is reasoning only if it closes it itself
        self.constrained = False
        self._held = ""  # a constrained stream's text, split at its end
        self._buf = ""  # a forced answer's text so far
        self._calls: list[ToolCall] = []  # forced calls made
        self._named_started = False
        # the reasoning tokens generated (usage's completion_tokens_details): a parser of
        # its own, fed token by token, counts those inside the reasoning
        self.reasoning_tokens = 0
        self._counter = (type(self.reasoning)(self.reasoning.thinking)
                         if self.reasoning is not None and self.reasoning.thinking else None)

    @property
    def keeps_special_tokens(self) -> bool:
        """The parser's markers are special tokens: the text must keep them (vLLM's
        adjust_request)."""
        return self.tools is not None and self.tools.needs_special_tokens

    def grammar(self, body: ChatCompletionRequest) -> str | None:
        """The grammar a forced choice needs (None: auto or none)."""
        by_name = {t.function.name: t.function.parameters or {"type": "object"}
                   for t in body.tools or ()}
        if self.mode in ("auto", "none"):
            return None
        if self.mode != "required":
            return json_schema_grammar(by_name[self.mode])
        items = {"anyOf": [{"type": "object", "required": ["name", "parameters"],
                            "additionalProperties": False,
                            "properties": {"name": {"type": "string", "enum": [name]},
                                           "parameters": schema}}
                           for name, schema in by_name.items()]}
        schema = {"type": "array", "minItems": 1, "items": items}
        if not self.parallel:
            schema["maxItems"] = 1
        return json_schema_grammar(schema)

    @property
    def thinks(self) -> bool:
        """The answer starts in its reasoning (a reasoning parser, thinking on)."""
        return self.reasoning is not None and self.reasoning.thinking

    def grammar_after(self) -> str | None:
        """Where a grammar (the request's, or a forced call's) starts to bind: the text
        that closes a thinking answer's reasoning, after which the answer obeys it
        (vLLM's order); None: from the first token (no reasoning, or
        --structured-outputs-config enable_in_reasoning)."""
        if self.reasoning is None or not self.thinks or self.grammar_in_reasoning:
            return None
        return self.reasoning.end

    def called(self) -> bool:
        return bool(self._calls or (self.tools is not None and self.tools.calls))

    def finish_reason(self, reason: str | None) -> str | None:
        """vLLM's: "tool_calls" when auto or required made calls (a named call: as is)."""
        if self.mode in ("auto", "required") and self.called() and reason in ("stop", None):
            return "tool_calls"
        return reason

    @property
    def counting(self) -> bool:
        """Still inside the reasoning: ``count`` wants each token's text."""
        return self._counter is not None

    @property
    def usage_details(self) -> dict[str, Any] | None:
        """usage's completion_tokens_details (with a reasoning parser, as vLLM's)."""
        return None if self.reasoning is None else {"reasoning_tokens": self.reasoning_tokens}

    def count(self, pieces: list[tuple[str, int]]) -> None:
        """Count the generated tokens that are reasoning: those before the reasoning's
        end, less its markers (vLLM counts the tokens between its start and end tokens).
        ``pieces``: the text of each token in order, with 1; a character split over
        several tokens comes whole, with their number."""
        machine = self._counter
        for piece, tokens in pieces:
            if machine is None:
                return
            opening = machine.in_opening
            _, content = machine.feed(piece)
            if content or not machine.in_reasoning and not machine.in_opening:
                self._counter = machine = None  # (this token closed it)
            elif not (opening and piece.strip() == machine.start):
                self.reasoning_tokens += tokens

    # -- whole ---------------------------------------------------------------------------
    def _split_whole(self, text: str) -> tuple[str | None, str | None]:
        r = self.reasoning
        if r is None or (self.constrained and not any(
                m and m in text for m in (r.end, r.implicit_end))):
            return None, text
        return r.extract(text)

    def message(self, text: str) -> dict[str, Any]:
        reasoning, content = self._split_whole(text)
        # (OpenAI's fields for what is never made here: null, as vLLM answers them)
        msg: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None,
                               "annotations": None, "audio": None, "function_call": None,
                               "reasoning": None if self.hides_reasoning else reasoning}
        calls: list[ToolCall] = []
        if self.tools is not None:
            msg["content"], calls = self.tools.extract(content or "")
        elif self.mode == "required":
            calls = _listed_calls(content or "")
            msg["content"] = None if calls else content
        elif self.mode != "none" and content:  # (none while it still reasons: vLLM's)
            calls = [ToolCall(call_id(), self.mode, content)]
            msg["content"] = None
        calls = calls if self.parallel else calls[:1]
        self._calls = calls
        if calls:  # (none: no tool_calls field, as vLLM and OpenAI answer)
            msg["tool_calls"] = [_call_json(c) for c in calls]
        return msg

    # -- a stream ------------------------------------------------------------------------
    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._route(*self._split(text, final=False), final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._route(*self._split("", final=True), final=True)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self.reasoning is None:
            return "", text
        if self.constrained:  # held whole: whether it reasons is known at its end
            self._held += text
            if not final:
                return "", ""
            reasoning, content = self._split_whole(self._held)
            return reasoning or "", content or ""
        return self.reasoning.finish() if final else self.reasoning.feed(text)

    def _route(self, reasoning: str, content: str, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"reasoning": reasoning}] if reasoning and \
            not self.hides_reasoning else []
        if self.tools is not None:
            parts = self.tools.feed(content) if content else []
            parts += self.tools.finish() if final else []
            out += parts if self.parallel else [_first_call_only(d) for d in parts]
        elif self.mode == "none":
            out += [{"content": content}] if content else []
        elif self.mode == "required":
            self._buf += content
            if final:
                self._calls = _listed_calls(self._buf)[:None if self.parallel else 1]
                out += [{"tool_calls": [{"index": i, **_call_json(c)}]}
                        for i, c in enumerate(self._calls)]
                if not self._calls and self._buf:
                    out.append({"content": self._buf})
        else:
            out += self._named(content)
        return [d for d in out if d and (d.get("content") != "" or len(d) > 1)]

    def _named(self, fragment: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not fragment:  # (the call starts with its arguments: none while it reasons)
            return out
        if not self._named_started:
            self._named_started = True
            call = ToolCall(call_id(), self.mode, "")
            self._calls = [call]
            out.append({"tool_calls": [{"index": 0, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
        self._calls[0].arguments += fragment
        out.append({"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]})
        return out


def _first_call_only(delta: dict[str, Any]) -> dict[str, Any]:
    """A stream's delta without its calls past the first (parallel_tool_calls false:
    vLLM sends the deltas of call 0 only)."""
    if "tool_calls" not in delta:
        return delta
    calls = [c for c in delta["tool_calls"] if c["index"] == 0]
    rest = {k: v for k, v in delta.items() if k != "tool_calls"}
    return {**rest, "tool_calls": calls} if calls else rest


def _call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _listed_calls(text: str) -> list[ToolCall]:
    """A ``required`` answer: the JSON list of {name, parameters} its grammar forced
    (none when it was cut short)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    return [ToolCall(call_id(), it["name"], json.dumps(it.get("parameters", {}),
                                                          ensure_ascii=False))
            for it in items if isinstance(it, dict) and isinstance(it.get("name"), str)]
