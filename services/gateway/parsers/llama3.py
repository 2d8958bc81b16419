"""The llama3_json tool-call parser (SGLang's "llama3"): Llama 3.1+ writes its calls as
JSON objects, optionally after ``<|python_tag|>``, several joined by "; "::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

Read as vLLM's ``llama3_json`` parser reads a whole output: every ``{`` outside an object
already read starts one, which must be a JSON object with a string "name" and an
"arguments" (preferred) or "parameters" value of any JSON type; text around the objects
is dropped, and the first object that is not such a call makes the whole output content.

A stream agrees with that, object by object:

    content ──"{" or <|python_tag|>──▶ between objects (text dropped) ──"{"──▶ object
                                              ▲                                  │
                                              └──── a call (header, arguments) ◀─┤
    everything is content ◀── not a call, and no call sent yet ◀─────────────────┘

An object's header goes out once it reads ``{"name": "...", "parameters":`` (or
"arguments"), and its arguments then stream in ``json.dumps`` form as hermes's do; in any
other key order the call comes whole when the object closes. An object that cannot be a
call (its first key does not start right after "{") is known at once, so prose with
braces streams on; one that might be waits until it closes.

Where vLLM's two paths disagree this takes the whole-output path's calls, and keeps the
text before the first object as content as vLLM's stream does (vLLM's whole-output path
drops it, and its stream finds calls only when the output starts with one). vLLM's
whole-output path also skips a "{" right after an object's "}" (an off-by-one); here that
"{" opens the next object.
"""

from __future__ import annotations

import json
import re

from pdmesh.services.gateway.parsers.tools import ToolParser, json_text


class Llama3JsonToolParser(ToolParser):
    """Calls as ``{"name": ..., "parameters": {...}}`` objects; see the module docstring."""

    name = "llama3_json"
    needs_special_tokens = False  # vLLM's parser leaves skip_special_tokens alone
    starts = ("<|python_tag|>", "{")
    _HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:parameters|arguments)"'
                       r"\s*:")

    def __init__(self, tools: list[dict] | None):
        super().__init__(tools)
        self._prose = False  # an object that is not a call came first: all is content
        self._obj: str | None = None  # the open object's text, from its "{"
        self._depth = 0
        self._in_string = self._escape = False
        self._new_json_call()

    def _scan(self, final: bool) -> None:
        while True:
            if self._prose:
                self._say(self._text[self._content_len:])
                self._buf = ""
                return
            if self._bad:  # vLLM stops at the first object that fails
                self._buf = ""
                return
            if self._obj is None and not self._open():
                return
            closed = self._read()
            if self._cannot_be_call():
                self._reject()
                continue
            self._stream_json_call(self._obj or "")
            if closed:
                self._close(self._parse(self._obj or ""))
            elif final:  # unclosed at the end: not JSON
                self._close(None)
            else:
                return

    def _open(self) -> bool:
        """Drop text up to the next "{" and open an object there; False when none."""
        at = self._buf.find("{")
        if at == -1:
            self._buf = ""
            return False
        self._buf, self._obj, self._depth = self._buf[at:], "", 0
        self._in_string = self._escape = False
        self._new_json_call()
        return True

    def _read(self) -> bool:
        """Move text from the buffer into the open object; True once it closed."""
        for i, ch in enumerate(self._buf):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{}":
                self._depth += 1 if ch == "{" else -1
                if not self._depth:
                    self._obj = (self._obj or "") + self._buf[:i + 1]
                    self._buf = self._buf[i + 1:]
                    return True
        self._obj = (self._obj or "") + self._buf
        self._buf = ""
        return False

    def _cannot_be_call(self) -> bool:
        """Whether the object's text so far rules out a call: a call's "{" is followed by
        its first key's quote (only whitespace between)."""
        rest = (self._obj or "")[1:].lstrip()
        return not self._header and bool(rest) and rest[0] != '"'

    def _close(self, parsed: tuple[str, str] | None) -> None:
        """The open object ended; ``parsed`` is its call (name, arguments) or None."""
        self._obj = None
        if not self._header:
            if parsed is None:
                self._reject()
                return
            self._begin(parsed[0])
        self._end(parsed[1] if parsed else None)

    def _reject(self) -> None:
        """The open object is not a call: before any call, the whole output is content."""
        self._obj = None
        self._prose = not self._calls
        self._fail()

    @staticmethod
    def _parse(text: str) -> tuple[str, str] | None:
        try:
            call = json.loads(text)
        except (ValueError, RecursionError):
            return None
        name = call.get("name")
        key = "arguments" if "arguments" in call else "parameters"
        if not isinstance(name, str) or key not in call:
            return None
        return name, json_text(call[key])
