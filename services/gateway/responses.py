"""OpenAI's Responses API (``POST /v1/responses``) over the chat path: the request is
read into a chat completion (instructions as the system message, input items as
messages, function tools and calls, ``reasoning.effort``, ``text.format`` as
response_format), served as one, and its answer written back as a Response: reasoning,
message and function_call output items, whole or as the Responses stream's events.

Nothing is stored: ``previous_response_id`` is refused (400), ``store`` is accepted
without effect (as on the chat path).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pdmesh.services.gateway.protocol import Count


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None


def to_chat(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completion request ``req`` stands for. ValueError "field: why"."""
    if req.previous_response_id is not None:
        raise ValueError("previous_response_id: responses are not stored here; send the "
                         "conversation as input")
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        for i, item in enumerate(req.input):
            _add_item(messages, item, i)
    # the chat path's own fields (vLLM's extensions: guided_*, chat_template_kwargs, ...)
    # go on as given; what it does not know it warns of
    body: dict[str, Any] = {**(req.model_extra or {}), "model": req.model,
                            "messages": messages, "stream": req.stream}
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls")):
        if getattr(req, theirs) is not None:
            body[ours] = getattr(req, theirs)
    if req.tools:
        body["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    if (req.reasoning or {}).get("effort"):
        body["reasoning_effort"] = req.reasoning["effort"]  # type: ignore[index]
    fmt = (req.text or {}).get("format")
    if fmt and fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    elif fmt:
        body["response_format"] = {"type": fmt.get("type")}
    return body


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], i: int) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        content = item.get("content")
        if isinstance(content, list):
            content = [{"type": "text", "text": p.get("text")} if p.get("type") in (
                "input_text", "output_text", "text") else p for p in content]
        messages.append({"role": item.get("role"), "content": content})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": item.get("output")})
    elif kind != "reasoning":  # (earlier reasoning: the chat path drops it too)
        raise ValueError(f"input.{i}.type: {kind!r} items are not served (message, "
                         f"function_call, function_call_output, reasoning are)")


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ValueError(f"tools.{i}.type: only function tools are served, got "
                         f"{tool.get('type')!r}")
    return {"type": "function", "function": {
        k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}}


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


# -- the answer back ---------------------------------------------------------------------
def response(chat: dict[str, Any], req: ResponsesRequest) -> dict[str, Any]:
    """A whole chat completion as a Response."""
    msg = chat["choices"][0]["message"]
    out = _envelope(req, chat["created"], "completed")
    out["output"] = _items(msg)
    out["usage"] = _usage(chat["usage"])
    if chat["choices"][0]["finish_reason"] == "length":
        out["status"], out["incomplete_details"] = "incomplete", {"reason":
                                                                 "max_output_tokens"}
    return out


def _usage(u: dict[str, Any]) -> dict[str, Any]:
    """A chat's usage as a Response's (vLLM 0.32's per-turn lists: one turn, none
    kept; no built-in tools run here, so none of their output)."""
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {
                "cached_tokens": (u.get("prompt_tokens_details") or {}).get(
                    "cached_tokens", 0),
                "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
            "output_tokens_details": {
                "reasoning_tokens": (u.get("completion_tokens_details") or {}).get(
                    "reasoning_tokens", 0),
                "tool_output_tokens": 0, "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": []}}


def _envelope(req: ResponsesRequest, created: int, status: str) -> dict[str, Any]:
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": created,
            "status": status, "model": req.model, "output": [], "instructions":
            req.instructions, "tools": req.tools or [], "tool_choice": req.tool_choice or
            "auto", "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens":
            req.max_output_tokens, "incomplete_details": None, "error": None,
            "metadata": {}, "usage": None,
            # OpenAI's fields for what is not served here (background runs, stored
            # prompts and responses, truncation), as vLLM 0.32 fills them
            "background": False, "max_tool_calls": None, "previous_response_id": None,
            "prompt": None, "reasoning": req.reasoning, "service_tier": "auto",
            "text": req.text, "top_logprobs": None, "truncation": "disabled",
            "user": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "kv_transfer_params": None, "ec_transfer_params": None,
            "input_messages": None, "output_messages": None}


def _items(msg: dict[str, Any]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if msg.get("reasoning"):
        items.append(_reasoning_item(msg["reasoning"]))
    if msg.get("content"):
        items.append(_message_item(msg["content"]))
    for call in msg.get("tool_calls") or []:
        items.append(_call_item(call["id"], call["function"]["name"],
                                call["function"]["arguments"]))
    return items


def _reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _message_item(text: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant",
            "status": "completed", "phase": None,
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": None}]}


def _call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id,
            "name": name, "arguments": arguments, "status": "completed"}


async def events(chunks: AsyncIterator[Any], req: ResponsesRequest) -> AsyncIterator[str]:
    """The chat stream's chunks (SSE text) as the Responses stream's events."""
    stream = _Stream(req)
    for e in stream.start():
        yield e
    async for raw in chunks:
        for line in (raw.decode() if isinstance(raw, bytes) else raw).splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for e in stream.chunk(json.loads(line[6:])):
                    yield e
    for e in stream.end():
        yield e


class _Stream:
    """The Responses events of one answer, built from chat chunks: each output item
    added when its first text arrives, its deltas, then every item done and the
    whole response completed."""

    def __init__(self, req: ResponsesRequest):
        self.req = req
        self.response = _envelope(req, int(time.time()), "in_progress")
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # as they are built
        self.open: dict[str, int] = {}  # "reasoning" / "message" -> its output index
        self.calls: dict[int, int] = {}  # a chat tool call's index -> its output index
        self.usage: dict[str, Any] | None = None
        self.finish: str | None = None
        self.error: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return (f"event: {kind}\ndata: "
                f"{json.dumps({'type': kind, 'sequence_number': self.seq, **fields})}\n\n")

    def start(self) -> list[str]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def chunk(self, data: dict[str, Any]) -> list[str]:
        if "error" in data:
            self.error = data["error"]
            return []
        if data.get("usage"):
            self.usage = data["usage"]
        out: list[str] = []
        for choice in data.get("choices") or []:
            self.finish = choice.get("finish_reason") or self.finish
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                out += self._text("reasoning", delta["reasoning"])
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
        return out

    def _text(self, kind: str, text: str) -> list[str]:
        out = []
        if kind not in self.open:
            item = _reasoning_item("") if kind == "reasoning" else _message_item("")
            item["status"] = "in_progress"
            self.open[kind] = len(self.items)
            self.items.append(item)
            out.append(self._event("response.output_item.added",
                                   output_index=self.open[kind], item=item))
            if kind == "message":
                out.append(self._event("response.content_part.added", item_id=item["id"],
                                       output_index=self.open[kind], content_index=0,
                                       part=item["content"][0]))
        at = self.open[kind]
        item = self.items[at]
        item["content"][0]["text"] += text
        name = ("response.reasoning_text.delta" if kind == "reasoning"
                else "response.output_text.delta")
        out.append(self._event(name, item_id=item["id"], output_index=at, content_index=0,
                               delta=text))
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        out = []
        fn = call.get("function") or {}
        if call["index"] not in self.calls:
            item = _call_item(call.get("id") or "", fn.get("name") or "", "")
            item["status"] = "in_progress"
            self.calls[call["index"]] = len(self.items)
            self.items.append(item)
            out.append(self._event("response.output_item.added",
                                   output_index=len(self.items) - 1, item=item))
        at = self.calls[call["index"]]
        if fn.get("arguments"):
            self.items[at]["arguments"] += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta",
                                   item_id=self.items[at]["id"], output_index=at,
                                   delta=fn["arguments"]))
        return out

    def end(self) -> list[str]:
        if self.error is not None:
            self.response.update(status="failed", error=self.error)
            return [self._event("response.failed", response=self.response)]
        out = []
        for at, item in enumerate(self.items):
            item["status"] = "completed"
            if item["type"] == "message":
                part = item["content"][0]
                out.append(self._event("response.output_text.done", item_id=item["id"],
                                       output_index=at, content_index=0, text=part["text"]))
                out.append(self._event("response.content_part.done", item_id=item["id"],
                                       output_index=at, content_index=0, part=part))
            elif item["type"] == "reasoning":
                out.append(self._event("response.reasoning_text.done", item_id=item["id"],
                                       output_index=at, content_index=0,
                                       text=item["content"][0]["text"]))
            else:
                out.append(self._event("response.function_call_arguments.done",
                                       item_id=item["id"], output_index=at,
                                       arguments=item["arguments"]))
            out.append(self._event("response.output_item.done", output_index=at, item=item))
        self.response["output"] = self.items
        self.response["status"] = "incomplete" if self.finish == "length" else "completed"
        if self.finish == "length":
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.usage is not None:
            self.response["usage"] = _usage(self.usage)
        kind = "response.incomplete" if self.finish == "length" else "response.completed"
        out.append(self._event(kind, response=self.response))
        return out
