"""Tool-call parsers: find the calls a model wrote into its output text, whole or streamed.

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

Arguments are JSON text in ``json.dumps(..., ensure_ascii=False)``'s form for the formats
whose arguments vLLM re-serializes (hermes, qwen3_coder, deepseek_v4), and the model's own
text for those vLLM passes through (deepseek_v3, deepseek_v31).
"""

from __future__ import annotations

import ast
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


def overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _object_text(text: str) -> str | None:
    """``text`` when it is a JSON object, else None."""
    try:
        return text if isinstance(json.loads(text), dict) else None
    except ValueError:
        return None


class ToolParser:
    """One request's parser (it holds the streaming state); subclasses give the markers
    that open the calls region and ``_scan``, which consumes ``self._buf``."""

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False  # markers are special tokens: keep them
    starts: ClassVar[tuple[str, ...]]  # markers that open the calls region

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
    """Rewrites a JSON object fed in pieces into ``json.dumps(..., ensure_ascii=False)``'s
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
        if not 0xD800 <= int(esc[2:6], 16) <= 0xDBFF:  # not a surrogate pair's first half
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
        self.text += json.dumps(decoded, ensure_ascii=False)[1:-1]


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
        self._header = False  # the open block's call went out
        self._canon: CanonicalJSON | None = None
        self._fed = 0  # characters of the body given to ``_canon``

    def _scan(self, final: bool) -> None:
        while True:
            if not self._open:
                if not self._skip_to(self._START, final):
                    return
                self._open, self._header, self._canon, self._fed = True, False, None, 0
            at = self._buf.find(self._END)
            if at == -1 and not final:
                self._progress(self._buf[:len(self._buf) - overlap(self._buf, self._END)])
                return
            body = self._buf if at == -1 else self._buf[:at]
            self._buf = "" if at == -1 else self._buf[at + len(self._END):]
            self._progress(body)
            self._close(body)
            if at == -1:
                return

    def _progress(self, body: str) -> None:
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
            if isinstance(args, str):  # vLLM decodes arguments written as a JSON string
                args = json.loads(args)
        except (ValueError, KeyError, TypeError):
            return None
        if not isinstance(call.get("name"), str) or not isinstance(args, dict):
            return None
        return call["name"], json.dumps(args, ensure_ascii=False)


# -- qwen3_coder -------------------------------------------------------------------------
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
            number = float(value)
        except ValueError:
            return value
        return number if not math.isfinite(number) or number != int(number) else int(number)
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


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
        self._args(("{" if first else ", ") + json.dumps(key, ensure_ascii=False) + ": "
                   + json.dumps(converted, ensure_ascii=False))
        return True

    def _close(self) -> bool:
        """End the function: what is left of its JSON ("}", or "{}") goes out."""
        self._in_fn = False
        self._end(json.dumps(self._values, ensure_ascii=False))
        return True


# -- deepseek_v3 / deepseek_v31 ----------------------------------------------------------
class DeepSeekV31ToolParser(ToolParser):
    """DeepSeek-V3.1: ``<｜tool▁calls▁begin｜>`` then per call
    ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{args}<｜tool▁call▁end｜>``, then
    ``<｜tool▁calls▁end｜>``. The arguments are the model's text, streamed as written."""

    name = "deepseek_v31"
    starts = ("<｜tool▁calls▁begin｜>",)
    _BEGIN, _SEP, _END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"

    def __init__(self, tools: list[dict] | None):
        super().__init__(tools)
        self._open = False
        self._header = False

    def _scan(self, final: bool) -> None:
        while True:
            if not self._open:
                if not self._skip_to(self._BEGIN, final):
                    return
                self._open, self._header = True, False
            at = self._buf.find(self._END)
            if at == -1 and not final:
                self._progress(self._buf, complete=False)
                return
            body = self._buf if at == -1 else self._buf[:at]
            self._buf = "" if at == -1 else self._buf[at + len(self._END):]
            self._open = False
            if at == -1:  # unclosed at the end: vLLM finds no such call
                self._progress(body, complete=False)
                if self._header:
                    self._end(None)
                else:
                    self._fail()
                return
            self._progress(body, complete=True)

    def _head(self, body: str) -> tuple[str, int] | None:
        """The call's name and where its arguments start, once both are known."""
        sep = body.find(self._SEP)
        return None if sep == -1 else (body[:sep], sep + len(self._SEP))

    _TAIL = ""  # text that closes the arguments before the call's end marker

    def _progress(self, body: str, complete: bool) -> None:
        head = self._head(body)
        if head is None:
            if complete:
                self._fail()
            return
        if not self._header:
            self._begin(head[0])
            self._header = True
        args = body[head[1]:]
        if complete:
            ok = args.endswith(self._TAIL)
            self._end(_object_text(args[:len(args) - len(self._TAIL)]) if ok else None)
            return
        tail = self._TAIL + self._END
        held = overlap(args, tail)
        self._args(args[:len(args) - held][len(self._calls[-1].arguments):])


class DeepSeekV3ToolParser(DeepSeekV31ToolParser):
    """DeepSeek-V3: as V3.1, but each call reads
    ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{args}\\n```<｜tool▁call▁end｜>``."""

    name = "deepseek_v3"
    _FENCE = "\n```json\n"
    _TAIL = "\n```"

    def _head(self, body: str) -> tuple[str, int] | None:
        sep = body.find(self._SEP)
        line = body.find("\n", sep + len(self._SEP)) if sep != -1 else -1
        if line == -1 or len(body) < line + len(self._FENCE):
            return None
        if not body.startswith(self._FENCE, line):
            return None
        return body[sep + len(self._SEP):line], line + len(self._FENCE)


# -- deepseek_v4 -------------------------------------------------------------------------
_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string",
    "enum": "string", "int": "integer", "int32": "integer", "int64": "integer",
    "uint": "integer", "uint32": "integer", "uint64": "integer", "long": "integer",
    "short": "integer", "unsigned": "integer", "float": "number", "float32": "number",
    "float64": "number", "double": "number", "bool": "boolean", "dict": "object",
    "arr": "array", "list": "array", "sequence": "array",
}
_JSON_KINDS = {None: "null", bool: "boolean", int: "integer", float: "number",
               str: "string", list: "array", dict: "object"}


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter schema allows: its "type", its enum values' types and
    those of its anyOf/oneOf/allOf branches; {"string"} when it names none."""
    if not isinstance(schema, dict):
        return {"string"}
    kinds: set[str] = set()
    declared = schema.get("type")
    kinds.update([declared] if isinstance(declared, str) else
                 [t for t in declared if isinstance(t, str)] if isinstance(declared, list)
                 else [])
    for value in schema.get("enum") or [] if isinstance(schema.get("enum"), list) else []:
        kinds.add(_JSON_KINDS.get(None if value is None else type(value), "string"))
    for branch in ("anyOf", "oneOf", "allOf"):
        for choice in schema.get(branch, []) if isinstance(schema.get(branch), list) else []:
            kinds |= schema_types(choice)
    return kinds or {"string"}


def _finite(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
        return True
    except ValueError:
        return False


def coerce_to_schema(value: str, kinds: set[str]) -> Any:
    """A ``string="false"`` DSML value as the first of its schema's types it reads as,
    in vLLM's order null, integer, number, boolean, object/array, string."""
    kinds = {_ALIASES.get(k.strip().lower(), k.strip().lower()) for k in kinds}
    for kind in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if kind not in kinds:
            continue
        if kind == "string":
            return value
        if kind == "null" and value.lower() == "null":
            return None
        if kind == "boolean" and value.lower().strip() in ("true", "1", "false", "0"):
            return value.lower().strip() in ("true", "1")
        try:
            if kind == "integer":
                return int(value)
            if kind == "number" and math.isfinite(number := float(value)):
                return number if number != int(number) else int(number)
            if kind in ("object", "array") and _finite(parsed := json.loads(value)):
                return parsed
        except ValueError:
            continue
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if _finite(parsed) else value


class DeepSeekV4ToolParser(ToolParser):
    """DeepSeek-V4's DSML (V3.2's grammar in a ``tool_calls`` wrapper)::

        <｜DSML｜tool_calls>
        <｜DSML｜invoke name="get_weather">
        <｜DSML｜parameter name="city" string="true">杭州</｜DSML｜parameter>
        <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
        </｜DSML｜invoke>
        </｜DSML｜tool_calls>

    ``string="true"`` values are text (streamed as written); others take the schema's
    type once complete. A block left unclosed at the end holds no calls, as in vLLM."""

    name = "deepseek_v4"
    needs_special_tokens = True
    starts = ("<｜DSML｜tool_calls>",)
    _BLOCK, _BLOCK_END = "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"
    _INVOKE, _INVOKE_END = "<｜DSML｜invoke", "</｜DSML｜invoke>"
    _PARAM, _PARAM_END = "<｜DSML｜parameter", "</｜DSML｜parameter>"
    _INVOKE_TAG = re.compile(r'<｜DSML｜invoke\s+name="([^"]+)"\s*>')
    _PARAM_TAG = re.compile(r'<｜DSML｜parameter\s+name="([^"]+)"\s+string="(true|false)"\s*>')

    def __init__(self, tools: list[dict] | None):
        super().__init__(tools)
        self._where = "outside"  # outside | block | invoke | param
        self._params: dict[str, tuple[str, str]] = {}  # name -> (raw value, string attr)
        self._param: tuple[str, str] = ("", "")
        self._value = ""
        self._hold = False  # stream no arguments for this call (a wrapper may be unwrapped)

    def _scan(self, final: bool) -> None:
        while True:
            step = {"outside": self._outside, "block": self._block,
                    "invoke": self._invoke, "param": self._param_value}[self._where]
            if not step(final):
                break
        if final and self._where != "outside":  # unclosed: vLLM sees no complete block
            if self._where in ("invoke", "param"):
                self._end(None)
            self._fail()
            self._where = "outside"

    def _outside(self, final: bool) -> bool:
        if not self._skip_to(self._BLOCK, final):
            return False
        self._where = "block"
        return True

    def _next_tag(self, markers: tuple[str, ...], final: bool) -> str | None:
        """Drop text up to the first of ``markers``; the one found, or None."""
        found = [(i, m) for m in markers if (i := self._buf.find(m)) != -1]
        if not found:
            keep = 0 if final else max(overlap(self._buf, m) for m in markers)
            self._buf = self._buf[len(self._buf) - keep:]
            return None
        at, marker = min(found)
        self._buf = self._buf[at:]
        return marker

    def _block(self, final: bool) -> bool:
        marker = self._next_tag((self._INVOKE, self._BLOCK_END), final)
        if marker == self._BLOCK_END:
            self._buf, self._where = self._buf[len(marker):], "outside"
            return True
        tag = self._INVOKE_TAG.match(self._buf) if marker else None
        if tag is None:
            return self._skip_bad_tag(marker)
        self._buf, self._where = self._buf[tag.end():], "invoke"
        self._begin(tag.group(1))
        self._params, self._hold = {}, False
        return True

    def _skip_bad_tag(self, marker: str | None) -> bool:
        """A tag that is not the expected one: skip it once it is complete."""
        if marker is None or ">" not in self._buf:
            return False
        self._buf = self._buf[len(marker):]
        return True

    def _invoke(self, final: bool) -> bool:
        marker = self._next_tag((self._PARAM, self._INVOKE_END), final)
        if marker == self._INVOKE_END:
            self._buf, self._where = self._buf[len(marker):], "block"
            arguments, self._hold = self._arguments(), False
            self._end(arguments)
            return True
        tag = self._PARAM_TAG.match(self._buf) if marker else None
        if tag is None:
            return self._skip_bad_tag(marker)
        self._buf, self._where = self._buf[tag.end():], "param"
        self._param, self._value = (tag.group(1), tag.group(2)), ""
        self._hold = self._hold or self._wrapper(tag.group(1))
        if tag.group(2) == "true":
            self._key_prefix()
            self._args('"')
        return True

    def _param_value(self, final: bool) -> bool:
        at = self._buf.find(self._PARAM_END)
        cut = at if at != -1 else len(self._buf) - overlap(self._buf, self._PARAM_END)
        piece, self._buf = self._buf[:cut], self._buf[cut:]
        self._value += piece
        name, string = self._param
        if string == "true":
            self._args(json.dumps(piece, ensure_ascii=False)[1:-1])
        if at == -1:
            return False
        self._buf, self._where = self._buf[len(self._PARAM_END):], "invoke"
        self._params[name] = (self._value, string)
        if string == "true":
            self._args('"')
        else:
            self._key_prefix()
            self._args(json.dumps(self._convert(name, self._value, string), ensure_ascii=False))
        return True

    def _key_prefix(self) -> None:
        first = not self._calls[-1].arguments
        self._args(("{" if first else ", ") + json.dumps(self._param[0], ensure_ascii=False)
                   + ": ")

    def _args(self, fragment: str) -> None:
        if not self._hold:
            super()._args(fragment)

    def _wrapper(self, name: str) -> bool:
        """A first parameter "arguments"/"input" that the schema lacks may be a wrapper
        vLLM unwraps, so this call's arguments wait for its end."""
        props = self._properties(self._calls[-1].name)
        return not self._calls[-1].arguments and bool(props) and \
            name in ("arguments", "input") and name not in props

    def _convert(self, name: str, value: str, string: str) -> Any:
        if string == "true":
            return value
        props = self._properties(self._calls[-1].name)
        return coerce_to_schema(value, schema_types(props.get(name, {})))

    def _arguments(self) -> str:
        values = {k: self._convert(k, v, s) for k, (v, s) in self._params.items()}
        props = self._properties(self._calls[-1].name)
        for wrapper in ("arguments", "input"):  # vLLM's _repair_param_dict
            if set(values) != {wrapper} or wrapper in props:
                continue
            inner = values[wrapper]
            if isinstance(inner, str):
                try:
                    inner = json.loads(inner)
                except ValueError:
                    break
            if isinstance(inner, dict) and set(inner) <= set(props):
                values = inner
        return json.dumps(values, ensure_ascii=False)
