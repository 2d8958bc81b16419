"""The qwen3_coder tool-call parser (Qwen3-Coder's XML-like calls), as vLLM's
``qwen3_coder`` parser reads them."""

from __future__ import annotations

import ast
import json
from typing import Any

from pdmesh.services.gateway.parsers.tools import ToolParser, as_number, is_json, json_text, overlap


def qwen3_coder_value(value: str, param: str, props: dict[str, Any]) -> Any:
    """A parameter's text as the type its schema names (vLLM's Qwen3-Coder rules: "null"
    is None; undeclared or string parameters stay text; a value that does not convert
    stays text, except booleans, where anything but "true" is False)."""
    if value.lower() == "null":
        return None
    if param not in props:
        return value
    spec = props[param]
    kind = str(spec["type"]).strip().lower() if isinstance(spec, dict) and "type" in spec \
        else "string"
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            return as_number(value)
        except ValueError:
            return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value
    return parsed if is_json(parsed) else value


class Qwen3CoderToolParser(ToolParser):
    """``<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>``
    (the wrapper may be missing; a parameter or function may be left unclosed at the end).
    Values lose one leading and one trailing newline and take their schema type; each
    parameter's JSON goes out when it completes, as vLLM streams it."""

    name = "qwen3_coder"
    starts = ("<tool_call>", "<function=")
    _FN, _FN_END = "<function=", "</function>"
    _PARAM, _PARAM_END = "<parameter=", "</parameter>"

    def __init__(self, tools: list[dict] | None):
        super().__init__(tools)
        self._in_fn = False
        self._header = False
        self._values: dict[str, Any] = {}
        self._props: dict[str, Any] = {}

    def _scan(self, final: bool) -> None:
        while True:
            if not self._in_fn:
                if not self._skip_to(self._FN, final):
                    return
                self._in_fn, self._header = True, False
            if not self._header and not self._read_header(final):
                return
            if not self._read_params(final):
                return

    def _read_header(self, final: bool) -> bool:
        gt = self._buf.find(">")
        if gt == -1:
            if final:  # "<function=" with no name: vLLM gives up on the whole output
                self._in_fn, self._bad = False, True
            return False
        self._begin(self._buf[:gt])
        self._buf, self._header, self._values = self._buf[gt + 1:], True, {}
        self._props = self._properties(self._calls[-1].name)
        return True

    def _read_params(self, final: bool) -> bool:
        """Read the function's parameters; True once it ended."""
        while True:
            fn_end, param = self._buf.find(self._FN_END), self._buf.find(self._PARAM)
            if fn_end != -1 and (param == -1 or fn_end < param):
                self._buf = self._buf[fn_end + len(self._FN_END):]
                return self._close()
            if param == -1:
                keep = 0 if final else max(overlap(self._buf, self._FN_END),
                                           overlap(self._buf, self._PARAM))
                self._buf = self._buf[len(self._buf) - keep:]
                return final and self._close()
            if not self._read_param(self._buf[param + len(self._PARAM):], final):
                return False

    def _read_param(self, rest: str, final: bool) -> bool:
        """One parameter, ``rest`` being the text after its "<parameter="; False when it
        is not complete yet (at the end it is: an unclosed value runs to the end)."""
        gt = rest.find(">")
        if gt == -1:
            if final:  # a cut-off "<parameter=": vLLM gives up on the whole output
                self._buf, self._bad = "", True
            return final
        ends = [i for i in (rest.find(m, gt + 1) for m in
                            (self._PARAM_END, self._PARAM, self._FN_END)) if i != -1]
        if not ends and not final:
            return False
        end = min(ends, default=len(rest))
        value = rest[gt + 1:end]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        closed = rest.startswith(self._PARAM_END, end)
        self._buf = rest[end + len(self._PARAM_END) if closed else end:]
        key = rest[:gt]
        converted = qwen3_coder_value(value, key, self._props)
        first = not self._values
        self._values[key] = converted
        self._args(("{" if first else ", ") + json_text(key) + ": "
                   + json_text(converted))
        return True

    def _close(self) -> bool:
        """End the function: what is left of its JSON ("}", or "{}") goes out."""
        self._in_fn = False
        self._end(json_text(self._values))
        return True
