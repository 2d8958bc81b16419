"""DeepSeek-V4's chat format (``--tokenizer-mode deepseek_v4``): OpenAI chat messages to the
prompt text, as DeepSeek's own Python encoder writes it (DeepSeek ships V4's format as
``encoding/encoding_dsv4.py`` in the model repository, not as a Jinja template).

A prompt, turn by turn::

    BOS [effort prefix] system [\\n\\n## Tools ...]            tools ride on the first system
    <｜User｜>question<｜Assistant｜><think>                      generation prompt, thinking mode
    reasoning</think>answer[\\n\\n<｜DSML｜tool_calls>...]EOS    an assistant turn
    <｜User｜><tool_result>...</tool_result><｜Assistant｜>...    tool results are user turns

- Chat mode (``thinking=False``) opens every assistant turn with ``</think>`` and never
  writes reasoning.
- Thinking mode opens the turn after the last user message with ``<think>``. Without tools,
  earlier turns lose their reasoning (``<｜Assistant｜></think>answer``) and developer
  messages before the last user message are dropped. With tools anywhere in the
  conversation, every turn keeps its reasoning and opens with ``<think>``.
- ``tool`` messages become ``<tool_result>`` blocks of one user turn (joined by a blank
  line, ordered as the calls were), and a user message right after them joins that turn.

Beyond OpenAI's fields the encoder reads DeepSeek's own: a ``latest_reminder`` role, a
message's ``tools`` (rendered where that message is) and a user message's ``task``.

The effort prefix follows the V4 preview encoder (one prefix, for xhigh/max); vLLM 0.32
implements DeepSeek's later revision (docs/vllm-crosscheck.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, THINK_START,
                                   THINK_END, DSML, *TASK_TOKENS.values())

# Prepended after BOS in thinking mode at the top effort; lower efforts add nothing.
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to"
    " resolve the root cause, rigorously stress-testing your logic against all potential"
    " paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate"
    " step, considered alternative, and rejected hypothesis to ensure absolutely no"
    " assumption is left unchecked.\n\n"
)
# OpenAI's levels as vLLM maps them for V4: "none" turns thinking off, "xhigh"/"max" are
# the top effort, the rest render as the default.
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")

_TOOLS_SECTION = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools \
by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types \
(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete \
reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool \
calls.
"""


@dataclass
class _Part:
    """One piece of a user turn: its text, or a tool's result (``call_id`` names the call)."""

    text: str
    is_result: bool = False
    call_id: str = ""


@dataclass
class _Turn:
    """A message after checking; ``parts`` is set on user turns only."""

    role: str
    content: str = ""
    parts: list[_Part] = field(default_factory=list)
    reasoning: str = ""
    calls: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)  # id, name, args
    tools: list[dict[str, Any]] | None = None
    task: str | None = None
    open_end: bool = False  # continue_final_message: no EOS after this assistant turn


def encode_messages(messages: list[dict], *, tools: list[dict] | None = None,
                    thinking: bool = False, reasoning_effort: str | None = None,
                    add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
    """The prompt text for ``messages``; ValueError names what cannot be encoded."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message: choose one")
    if reasoning_effort is not None and reasoning_effort not in _EFFORTS:
        raise ValueError(f"reasoning_effort: {reasoning_effort!r} is not one of {_EFFORTS}")
    thinking = thinking and reasoning_effort != "none"
    turns = _turns(messages, tools, continue_final_message)
    drop = thinking and not any(t.tools for t in turns)
    if drop:
        last = _last_user(turns)
        turns = [t for i, t in enumerate(turns) if t.role != "developer" or i >= last]
    prompt = BOS
    if thinking and reasoning_effort in ("xhigh", "max"):
        prompt += REASONING_EFFORT_MAX
    last = _last_user(turns)
    for i, turn in enumerate(turns):
        prompt += _render(turn, turns[i - 1] if i else None, thinking, keep=not drop or i > last)
        nxt = turns[i + 1].role if i + 1 < len(turns) else None
        if nxt in (None, "assistant", "latest_reminder") and (nxt or add_generation_prompt):
            prompt += _reply_opening(turn, thinking, think=not drop or i >= last)
    return prompt


def _turns(messages: list[dict], tools: list[dict] | None, open_end: bool) -> list[_Turn]:
    """The checked messages with tool results merged and the request's tools placed;
    ``open_end``: the last one is an assistant turn left open."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: expected a non-empty list")
    turns = _with_tools(_merge_tool_results([_check(i, m) for i, m in enumerate(messages)]),
                        tools)
    if open_end:
        if turns[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message is not the assistant's")
        turns[-1] = replace(turns[-1], open_end=True)
    return turns


def _with_tools(turns: list[_Turn], tools: list[dict] | None) -> list[_Turn]:
    """The request's tools ride on the first system message, wherever it is (replacing
    any of its own), else on a system message put first - as vLLM places them."""
    functions = _check_tools(tools, "tools")
    if not functions:
        return turns
    at = next((i for i, t in enumerate(turns) if t.role == "system"), None)
    if at is None:
        return [_Turn("system", tools=functions), *turns]
    return [*turns[:at], replace(turns[at], tools=functions), *turns[at + 1:]]


def _check(i: int, m: Any) -> _Turn:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ValueError(f"{where}: expected an object")
    role = m.get("role")
    if role not in _ROLES:
        raise ValueError(f"{where}: unknown role {role!r} (expected one of {_ROLES})")
    if role == "tool":
        result = _Part(_tool_result_text(m.get("content"), where), is_result=True,
                       call_id=str(m.get("tool_call_id") or ""))
        return _Turn("tool", parts=[result])
    content = _text(m.get("content"), where)
    if role == "developer" and not content:
        raise ValueError(f"{where}: a developer message needs content")
    task = m.get("task")
    if task is not None and task not in TASK_TOKENS:
        raise ValueError(f"{where}: unknown task {task!r} (expected one of {tuple(TASK_TOKENS)})")
    turn = _Turn(role, content, tools=_check_tools(m.get("tools"), f"{where}.tools"), task=task)
    if role == "assistant":
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        turn.reasoning = _text(reasoning, f"{where}.reasoning_content")
        turn.calls = [_check_call(c, f"{where}.tool_calls[{j}]")
                      for j, c in enumerate(m.get("tool_calls") or [])]
    return turn


def _text(content: Any, where: str) -> str:
    """A message's text: a string, None, or a list of text parts (joined as they are)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(_part_text(p, f"{where}[{k}]") for k, p in enumerate(content))
    raise ValueError(f"{where}: content must be a string, null or a list of text parts")


def _part_text(part: Any, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
        raise ValueError(f"{where}: only text parts can be encoded")
    if not isinstance(part.get("text"), str):
        raise ValueError(f"{where}: a text part needs a string 'text'")
    return part["text"]


def _tool_result_text(content: Any, where: str) -> str:
    """A tool's result; list parts join by a blank line, DeepSeek naming the kinds it lacks."""
    if not isinstance(content, list):
        return _text(content, where)
    texts = []
    for k, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") not in ("text", "input_text"):
            texts.append(f"[Unsupported {part.get('type')}]")
        else:
            texts.append(_part_text(part, f"{where}[{k}]"))
    return "\n\n".join(texts)


def _check_tools(tools: Any, where: str) -> list[dict[str, Any]] | None:
    """The function definitions of OpenAI-format tools."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise ValueError(f"{where}: expected a list of tools")
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise ValueError(f"{where}[{k}]: expected {{'type': 'function', 'function': {{...}}}}")
    return [tool["function"] for tool in tools]


def _check_call(call: Any, where: str) -> tuple[str, str, dict[str, Any]]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}: expected {{'function': {{'name': ..., 'arguments': ...}}}}")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            parsed = None
        # DeepSeek writes arguments that are not a JSON object as one string parameter
        args = parsed if isinstance(parsed, dict) else {"arguments": args}
    if not isinstance(args, dict):
        raise ValueError(f"{where}.function.arguments: expected a JSON string or an object")
    return str(call.get("id") or fn.get("id") or ""), fn["name"], args


def _merge_tool_results(turns: list[_Turn]) -> list[_Turn]:
    """Tool results join the user turn before them (or start one), a user message joins a
    user turn before it unless that one has a task, and each turn's results follow the
    order of the assistant's last calls."""
    merged: list[_Turn] = []
    order: dict[str, int] = {}
    calls_pending = False
    for i, turn in enumerate(turns):
        if turn.role == "assistant":
            calls_pending = bool(turn.calls)
        if turn.role == "assistant" and turn.calls:
            order = {cid: k for k, (cid, _, _) in enumerate(turn.calls) if cid}
        if turn.role == "tool":
            if not calls_pending:
                raise ValueError(f"messages[{i}]: a tool message with no assistant tool call "
                                 "before it")
            if merged and merged[-1].role == "user":
                merged[-1].parts.append(turn.parts[0])
            else:
                merged.append(_Turn("user", parts=[turn.parts[0]]))
            _order_results(merged[-1].parts, order)
        elif turn.role == "user" and merged and merged[-1].role == "user" \
                and merged[-1].task is None:
            merged[-1].parts.append(_Part(turn.content))
        elif turn.role == "user":
            merged.append(replace(turn, parts=[_Part(turn.content)], tools=None))
        else:
            merged.append(turn)
    return merged


def _order_results(parts: list[_Part], order: dict[str, int]) -> None:
    """Sort the tool results among ``parts`` by call order, in place; text stays put."""
    slots = [k for k, p in enumerate(parts) if p.is_result]
    ranked = sorted((parts[k] for k in slots), key=lambda p: order.get(p.call_id, 0))
    for k, part in zip(slots, ranked, strict=True):
        parts[k] = part


def _last_user(turns: list[_Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


def _render(turn: _Turn, prev: _Turn | None, thinking: bool, keep: bool) -> str:
    """One turn's text; ``keep``: an assistant turn writes its reasoning in thinking mode."""
    if turn.role == "system":
        return turn.content + _tools_text(turn.tools)
    if turn.role == "developer":
        return USER + turn.content + _tools_text(turn.tools)
    if turn.role == "latest_reminder":
        return LATEST_REMINDER + turn.content
    if turn.role == "user":
        return USER + "\n\n".join(f"<tool_result>{p.text}</tool_result>" if p.is_result
                                  else p.text for p in turn.parts)
    reasoning = ""
    if thinking and keep and (prev is None or prev.task is None):
        reasoning = turn.reasoning + THINK_END
    return reasoning + turn.content + _calls_text(turn.calls) + ("" if turn.open_end else EOS)


def _reply_opening(turn: _Turn, thinking: bool, think: bool) -> str:
    """What follows a user turn before the reply: a task's token, or the assistant marker
    and ``<think>`` (thinking mode, ``think``) or ``</think>``."""
    if turn.task == "action":
        return ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS["action"]
    if turn.task is not None:
        return TASK_TOKENS[turn.task]
    if turn.role not in ("user", "developer"):
        return ""
    return ASSISTANT + (THINK_START if thinking and think else THINK_END)


def _tools_text(tools: list[dict[str, Any]] | None) -> str:
    if not tools:
        return ""
    return "\n\n" + _TOOLS_SECTION.format(schemas="\n".join(_json(t) for t in tools))


def _calls_text(calls: list[tuple[str, str, dict[str, Any]]]) -> str:
    if not calls:
        return ""
    invokes = "\n".join(f'<{DSML}invoke name="{name}">\n{_params_text(args)}\n</{DSML}invoke>'
                        for _, name, args in calls)
    return f"\n\n<{DSML}tool_calls>\n{invokes}\n</{DSML}tool_calls>"


def _params_text(args: dict[str, Any]) -> str:
    """Strings as they are (``string="true"``), anything else as JSON."""
    return "\n".join(
        f'<{DSML}parameter name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
        f"{v if isinstance(v, str) else _json(v)}</{DSML}parameter>"
        for key, v in args.items())


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
