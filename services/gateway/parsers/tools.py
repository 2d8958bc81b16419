"""Tool-call parsers: find the calls a model wrote into its output text, whole or streamed.

This module holds what every format shares (``ToolCall``, the ``ToolParser`` state
machine, ``overlap``, ``CanonicalJSON``) and the hermes format; the others live beside it
(``qwen3_coder``, ``deepseek``, ``llama3``).

Each format is one small state machine over the text (``_scan``), and both shapes run it:
``feed``/``finish`` return OpenAI chat deltas as the text arrives, and ``extract`` runs a
fresh machine over the whole output, so the two agree by construction:

    content ──first call marker──▶ calls region ──▶ call: header (id, name) ──▶ argument
       │                               ▲            fragments ──▶ end (the authoritative
       │                               └──────────────── arguments, rest sent) ───┘
       └─ a tail that may still grow into a marker is held back; at the end it is content

Only text before the first call marker is content; text between and after calls is
dropped, as vLLM's non-streaming parsers do. When no call parses, or any call fails to
(bad JSON, unclosed block), ``extract`` gives the whole output back as content; a stream
cannot take back a header it already sent, so there the bad call keeps what it streamed.

Arguments are JSON text in ``json_text(...)``'s form for the formats
whose arguments vLLM re-serializes (hermes, qwen3_coder, deepseek_v4, llama3_json), and the
model's own text for those vLLM passes through (deepseek_v3, deepseek_v31).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar
from uuid import uuid4


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


def call_id() -> str:
    return f"chatcmpl-tool-{uuid4().hex}"


def json_text(value: Any) -> str:
    """``value`` as JSON text, non-ASCII characters as they are (vLLM's form); with a
    lone surrogate in it (not text: UTF-8 cannot hold one), escaped as \\uXXXX."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


def as_number(text: str) -> int | float:
    """``text`` as a JSON number, integral values as ints ("2.0" -> 2), as vLLM's
    parsers convert "number" parameters; ValueError when it is not one (infinities and
    NaN included: JSON has none)."""
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text!r} is not a finite number")
    return number if number != int(number) else int(number)


def is_json(value: Any) -> bool:
    """Whether ``value`` (a parsed literal) is JSON data: no set, bytes or infinity."""
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError):
        return False
    return True


def overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolParser:
    """One request's parser (it holds the streaming state); subclasses give the markers
    that open the calls region and ``_scan``, which consumes ``self._buf``."""

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False  # markers are special tokens: keep them
    starts: ClassVar[tuple[str, ...]]  # markers that open the calls region
    _HEAD: ClassVar[re.Pattern[str]]  # a JSON call's start, up to its arguments' value

    def __init__(self, tools: list[dict] | None):
        self.tools = tools or []
        self._text = ""  # everything received
        self._buf = ""  # text received and not yet consumed
        self._in_calls = False
        self._content_len = 0  # characters sent as content (always a prefix of the text)
        self._out: list[dict] = []
        self._calls: list[ToolCall] = []
        self._finals: list[str | None] = []  # each ended call's arguments, as extract gives
        self._bad = False  # some call did not parse: extract gives the text back as content

    # -- the interface -------------------------------------------------------------------
    @property
    def calls(self) -> list[ToolCall]:
        return self._calls

    def feed(self, delta: str) -> list[dict]:
        self._buf += delta
        self._text += delta
        self._step(final=False)
        return self._drain()

    def finish(self) -> list[dict]:
        self._step(final=True)
        if not self._calls:  # nothing parsed: every held character is content after all
            self._say(self._text[self._content_len:])
        return self._drain()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        machine = type(self)(self.tools)
        machine.feed(text)
        machine.finish()
        finals = machine._finals
        if machine._bad or not finals or len(finals) != len(machine.calls):
            return text or None, []
        calls = [ToolCall(call_id(), c.name, a or "")
                 for c, a in zip(machine.calls, finals, strict=True)]
        return text[:machine._content_len] or None, calls

    # -- the machinery subclasses use ----------------------------------------------------
    def _step(self, final: bool) -> None:
        if not self._in_calls:
            at = min((i for i in (self._buf.find(s) for s in self.starts) if i != -1),
                     default=-1)
            if at == -1:
                keep = 0 if final else max(overlap(self._buf, s) for s in self.starts)
                self._say(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return
            self._say(self._buf[:at])
            self._buf, self._in_calls = self._buf[at:], True
        self._scan(final)

    def _scan(self, final: bool) -> None:
        raise NotImplementedError

    def _drain(self) -> list[dict]:
        out, self._out = self._out, []
        return out

    def _say(self, text: str) -> None:
        if text and not self._calls:
            self._out.append({"content": text})
            self._content_len += len(text)

    def _begin(self, name: str) -> None:
        index = len(self._calls)
        self._calls.append(ToolCall(call_id(), name, ""))
        self._out.append({"tool_calls": [{
            "index": index, "id": self._calls[-1].id, "type": "function",
            "function": {"name": name, "arguments": ""}}]})

    def _args(self, fragment: str) -> None:
        if fragment:
            self._calls[-1].arguments += fragment
            self._out.append({"tool_calls": [{"index": len(self._calls) - 1,
                                              "function": {"arguments": fragment}}]})

    def _end(self, final: str | None) -> None:
        """The open call ended; ``final`` is its arguments as ``extract`` reports them."""
        sent = self._calls[-1].arguments
        if final is None:
            self._bad = True
        elif final.startswith(sent):
            self._args(final[len(sent):])
        self._finals.append(final)

    def _fail(self) -> None:
        """A call that never started did not parse."""
        self._bad = True

    def _skip_to(self, marker: str, final: bool) -> bool:
        """Drop text up to ``marker`` and the marker itself; False when it is not there
        yet (a tail that may grow into it is kept)."""
        at = self._buf.find(marker)
        if at == -1:
            keep = 0 if final else overlap(self._buf, marker)
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._buf = self._buf[at + len(marker):]
        return True

    def _new_json_call(self) -> None:
        """A call written as one JSON object opens (hermes, llama3_json): nothing of it
        sent yet."""
        self._header = False  # its call went out
        self._canon: CanonicalJSON | None = None
        self._fed = 0  # characters of its text given to ``_canon``

    def _stream_json_call(self, body: str) -> None:
        """Send what ``body``, the open JSON call's text so far, makes final: the header
        once ``_HEAD`` (the object's start, up to its arguments' value) matches, then the
        arguments in ``json_text`` form as they are written."""
        if not self._header:
            head = self._HEAD.match(body)
            if head is None:
                return
            self._begin(json.loads(head.group(1)))
            self._header, self._canon, self._fed = True, CanonicalJSON(), head.end()
        if self._canon is not None:
            self._canon.feed(body[self._fed:])
            self._fed = len(body)
            if not self._canon.broken:
                self._args(self._canon.text[len(self._calls[-1].arguments):])

    def _properties(self, function: str) -> dict[str, Any]:
        """The JSON-schema properties of the request's tool ``function`` ({} if none)."""
        for tool in self.tools:
            fn = tool.get("function") or {}
            if fn.get("name") == function:
                params = fn.get("parameters")
                if isinstance(params, dict):
                    props = params.get("properties", params)
                    return props if isinstance(props, dict) else {}
        return {}


# -- hermes ------------------------------------------------------------------------------
class CanonicalJSON:
    """Rewrites a JSON object fed in pieces into ``json_text(...)``'s
    text, as far as that text is final: whitespace dropped, ", " and ": " separators,
    string escapes decoded and re-escaped, numbers re-printed once they end. ``broken``
    when the input is not an object or not JSON; ``done`` once the object closed."""

    _SCALAR = frozenset("0123456789+-.eEtruefalsn")

    def __init__(self) -> None:
        self.text = ""
        self.broken = self.done = False
        self._depth = 0
        self._in_string = False
        self._escape = ""  # an escape sequence read so far, from its backslash
        self._scalar = ""  # a number or literal read so far

    def feed(self, chunk: str) -> None:
        for ch in chunk:
            if self.broken or self.done:
                return
            if self._in_string:
                self._string_char(ch)
            elif ch in self._SCALAR and self._depth:
                self._scalar += ch
            else:
                self._flush_scalar()
                self._structural(ch)

    def _structural(self, ch: str) -> None:
        if ch in " \t\r\n" or self.broken:
            return
        if not self._depth and ch != "{":
            self.broken = True
        elif ch in "{[":
            self._depth += 1
            self.text += ch
        elif ch in "}]":
            self._depth -= 1
            self.text += ch
            self.done = not self._depth
        elif ch in ',:"':
            self.text += {",": ", ", ":": ": ", '"': '"'}[ch]
            self._in_string = ch == '"'
        else:
            self.broken = True

    def _flush_scalar(self) -> None:
        if self._scalar:
            try:
                self.text += json.dumps(json.loads(self._scalar))
            except ValueError:
                self.broken = True
            self._scalar = ""

    def _string_char(self, ch: str) -> None:
        if self._escape:
            self._escape += ch
            if self._escape_complete():
                try:
                    self._emit(json.loads(f'"{self._escape}"'))
                except ValueError:
                    self.broken = True
                self._escape = ""
        elif ch == "\\":
            self._escape = ch
        elif ch == '"':
            self._in_string = False
            self.text += ch
        else:
            self._emit(ch)

    def _escape_complete(self) -> bool:
        esc = self._escape
        if esc[1] != "u":
            return True
        if len(esc) < 6:
            return False
        try:
            unit = int(esc[2:6], 16)
        except ValueError:  # not hex: the JSON is broken (its parse says so)
            return True
        if not 0xD800 <= unit <= 0xDBFF:  # not a surrogate pair's first half
            return True
        if len(esc) == 7 and esc[6] != "\\" or len(esc) == 8 and esc[7] != "u":
            self._escape, rest = esc[:6], esc[6:]  # a lone first half, then other text
            self._emit(json.loads(f'"{self._escape}"'))
            self._escape = ""
            self._string_char_all(rest)
            return False
        return len(esc) == 12

    def _string_char_all(self, text: str) -> None:
        for ch in text:
            self._string_char(ch)

    def _emit(self, decoded: str) -> None:
        self.text += json_text(decoded)[1:-1]


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call;
    the last block may be left unclosed. Arguments stream as they are written when the
    block opens with "name" then "arguments" (as the chat templates put them); in any
    other order they come whole when the block ends."""

    name = "hermes"
    needs_special_tokens = True
    starts = ("<tool_call>",)
    _START, _END = "<tool_call>", "</tool_call>"
    _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:')

    def __init__(self, tools: list[dict] | None):
        super().__init__(tools)
        self._open = False

    def _scan(self, final: bool) -> None:
        while True:
            if not self._open:
                if not self._skip_to(self._START, final):
                    return
                self._open = True
                self._new_json_call()
            at = self._buf.find(self._END)
            if at == -1 and not final:
                self._stream_json_call(self._buf[:len(self._buf) - overlap(self._buf, self._END)])
                return
            body = self._buf if at == -1 else self._buf[:at]
            self._buf = "" if at == -1 else self._buf[at + len(self._END):]
            self._stream_json_call(body)
            self._close(body)
            if at == -1:
                return

    def _close(self, body: str) -> None:
        self._open = False
        parsed = self._parse(body)
        if not self._header:
            if parsed is None:
                self._bad = True
                return
            self._begin(parsed[0])
        self._end(parsed[1] if parsed else None)

    @staticmethod
    def _parse(body: str) -> tuple[str, str] | None:
        try:
            call = json.loads(body)
            args = call["arguments"]
            if isinstance(args, str):  # JSON text of an object: the object (vLLM 0.32
                # passes it on as a JSON string; see docs/vllm-crosscheck.md)
                args = json.loads(args)
        except (ValueError, KeyError, TypeError):
            return None
        if not isinstance(call.get("name"), str) or not isinstance(args, dict):
            return None
        return call["name"], json_text(args)
