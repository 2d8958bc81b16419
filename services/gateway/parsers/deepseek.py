"""DeepSeek's tool-call parsers: deepseek_v3 and deepseek_v31 (special-token markers,
the model's own argument text) and deepseek_v4 (DSML, its values typed by the request's
JSON schemas), as vLLM's parsers of those names read them (docs/vllm-crosscheck.md)."""

from __future__ import annotations

import json
import re
from typing import Any

from pdmesh.services.gateway.parsers.tools import ToolParser, as_number, is_json, json_text, overlap


def _object_text(text: str) -> str | None:
    """``text`` when it is a JSON object, else None."""
    try:
        return text if isinstance(json.loads(text), dict) else None
    except ValueError:
        return None


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


def _canonical(kinds: set[str]) -> set[str]:
    return {_ALIASES.get(k.strip().lower(), k.strip().lower()) for k in kinds}


def coerce_to_schema(value: str, kinds: set[str]) -> Any:
    """A DSML value's text as the first of its schema's types it reads as, in vLLM's
    order null, integer, number, boolean, object/array, string."""
    kinds = _canonical(kinds)
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
            if kind == "number":
                return as_number(value)
            if kind in ("object", "array") and is_json(parsed := json.loads(value)):
                return parsed
        except ValueError:
            continue
    return _json_or_text(value)


def _json_or_text(value: str) -> Any:
    """``value`` read as JSON (how DSML writes every ``string="false"`` value), else the
    text itself (as a JSON infinity is: JSON cannot hold one)."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if is_json(parsed) else value


def _typed(value: Any, schema: Any) -> Any:
    """A DSML parameter's value corrected to its JSON schema, as vLLM's parsers do: text
    takes the schema's type (``coerce_to_schema``), an object's members and an array's
    items their own schemas where it gives them, any other value the type its JSON text
    reads as."""
    if not isinstance(schema, dict):
        return value
    if isinstance(value, str):
        return coerce_to_schema(value, schema_types(schema))
    if isinstance(value, dict):
        props = schema.get("properties")
        if not isinstance(props, dict):
            return value
        return {k: _typed(v, props[k]) if k in props else v for k, v in value.items()}
    if isinstance(value, list):
        items = schema.get("items")
        return [_typed(v, items) for v in value] if isinstance(items, dict) else value
    return coerce_to_schema(json_text(value), schema_types(schema))


def _as_written(value: str, string: str) -> Any:
    """A DSML parameter's value as written: text (``string="true"``), else JSON (or the
    text, when it is not JSON)."""
    return value if string == "true" else _json_or_text(value)


class DeepSeekV4ToolParser(ToolParser):
    """DeepSeek-V4's DSML (V3.2's grammar in a ``tool_calls`` wrapper)::

        <｜DSML｜tool_calls>
        <｜DSML｜invoke name="get_weather">
        <｜DSML｜parameter name="city" string="true">杭州</｜DSML｜parameter>
        <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
        </｜DSML｜invoke>
        </｜DSML｜tool_calls>

    ``string="true"`` values are text, streamed as written unless the schema gives their
    parameter a type other than string; other values (``string="false"``, or no
    attribute) are JSON, else text. Every value then takes its schema's type (``_typed``)
    and goes out once complete. A block left unclosed at the end holds no calls."""

    name = "deepseek_v4"
    needs_special_tokens = True
    starts = ("<｜DSML｜tool_calls>",)
    _BLOCK, _BLOCK_END = "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"
    _INVOKE, _INVOKE_END = "<｜DSML｜invoke", "</｜DSML｜invoke>"
    _PARAM, _PARAM_END = "<｜DSML｜parameter", "</｜DSML｜parameter>"
    _INVOKE_TAG = re.compile(r'<｜DSML｜invoke\s+name="([^"]+)"\s*>')
    _PARAM_TAG = re.compile(r'<｜DSML｜parameter\s+name="([^"]+)"(?:\s+string="([^"]*)")?\s*>')

    def __init__(self, tools: list[dict] | None):
        super().__init__(tools)
        self._where = "outside"  # outside | block | invoke | param
        self._params: dict[str, tuple[str, str]] = {}  # name -> (raw value, string attr)
        self._param: tuple[str, str] = ("", "")  # the open parameter's name, string attr
        self._value = ""
        self._as_text = False  # the open parameter's value streams as it is written
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
        name, string = tag.group(1), tag.group(2) or ""
        self._param, self._value = (name, string), ""
        self._hold = self._hold or self._wrapper(name)
        self._as_text = string == "true" and self._stays_text(name)
        if self._as_text:
            self._key_prefix()
            self._args('"')
        return True

    def _param_value(self, final: bool) -> bool:
        at = self._buf.find(self._PARAM_END)
        cut = at if at != -1 else len(self._buf) - overlap(self._buf, self._PARAM_END)
        piece, self._buf = self._buf[:cut], self._buf[cut:]
        self._value += piece
        name, string = self._param
        if self._as_text:
            self._args(json_text(piece)[1:-1])
        if at == -1:
            return False
        self._buf, self._where = self._buf[len(self._PARAM_END):], "invoke"
        self._params[name] = (self._value, string)
        if self._as_text:
            self._args('"')
        else:
            self._key_prefix()
            self._args(json_text(self._convert(name, self._value, string)))
        return True

    def _key_prefix(self) -> None:
        first = not self._calls[-1].arguments
        self._args(("{" if first else ", ") + json_text(self._param[0])
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

    def _stays_text(self, name: str) -> bool:
        """Whether a ``string="true"`` value of parameter ``name`` is sure to stay text
        (its schema, if any, allows only strings), so it can stream as written."""
        schema = self._properties(self._calls[-1].name).get(name)
        return not isinstance(schema, dict) or _canonical(schema_types(schema)) == {"string"}

    def _convert(self, name: str, value: str, string: str) -> Any:
        """A complete parameter's value, typed by its schema."""
        props = self._properties(self._calls[-1].name)
        return _typed(_as_written(value, string), props.get(name))

    def _arguments(self) -> str:
        values = {k: _as_written(v, s) for k, (v, s) in self._params.items()}
        props = self._properties(self._calls[-1].name)
        for wrapper in ("arguments", "input"):  # vLLM's _unwrap_wrapper_args
            if not props or set(values) != {wrapper} or wrapper in props:
                continue
            inner = values[wrapper]
            if isinstance(inner, str):
                try:
                    inner = json.loads(inner)
                except ValueError:
                    break
            if isinstance(inner, dict) and set(inner) <= set(props):
                values = inner
        return json_text(_typed(values, {"properties": props}))
