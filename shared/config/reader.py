"""Reads raw JSON values into the schema's frozen dataclasses, collecting every problem.

A bad value is reported and replaced by its default so that reading goes on and one
``ConfigError`` can list everything. The leniencies, each with a warning: a quoted
boolean ("true", "False") is read as the boolean, because vLLM-Ascend's own DeepSeek-V4
recipes write ``"enable_cpu_binding": "true"``; a key vLLM-Ascend reads through int() /
float() / bool() (``OptionSpec.cast``) takes what that cast takes ("256", 256.7, 1); a
null section is that section's defaults, as vLLM-Ascend reads ``section or {}``. Every
other mismatch is an error.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, is_dataclass
from typing import Any

from pdmesh.shared.config.errors import ConfigProblem
from pdmesh.shared.config.options import schema_fields, spec_of


@dataclass
class ReadContext:
    """What reading collects. ``shown`` maps a canonical dotted path to the name the user
    wrote (a deprecated spelling, or the key plus the environment variable that set it)."""

    root: type  # the top-level schema class; unknown keys are looked up in its whole tree
    problems: list[ConfigProblem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    explicit: set[str] = field(default_factory=set)  # canonical paths the user set
    shown: dict[str, str] = field(default_factory=dict)

    def problem(self, key: str, message: str) -> None:
        self.problems.append(ConfigProblem(key, message))


class _Mismatch(Exception):
    """A value of the wrong type; ``expected`` says what was wanted."""

    def __init__(self, expected: str) -> None:
        super().__init__(expected)
        self.expected = expected


def read_section(cls: type, raw: Mapping[str, Any], path: str, shown: str,
                 ctx: ReadContext, *, track: bool = True) -> Any:
    """An instance of schema dataclass ``cls`` from ``raw``; defaults where keys are absent.

    ``path`` is the canonical dotted path of ``raw`` ("" at the top), ``shown`` how to name
    it in messages; ``track`` False reads without recording explicit keys (ignored input).
    """
    hints = _hints(cls)
    known = {f.name for f in schema_fields(cls)}
    for key in raw:
        if key not in known:
            where = f"{shown}.{key}" if shown else str(key)
            ctx.problem(where, _unknown_key_message(ctx.root, cls, str(key), path))
    values = {}
    for f in schema_fields(cls):
        if f.name not in raw:
            continue
        child = f"{path}.{f.name}" if path else f.name
        child_shown = ctx.shown.get(child, f"{shown}.{f.name}" if shown else f.name)
        if track:
            ctx.explicit.add(child)
        spec = spec_of(f)
        given = raw[f.name]
        if spec is not None and spec.cast:
            given = _cast(hints[f.name], given, child_shown, ctx)
        if (spec is not None and spec.truthy and isinstance(given, str)
                and given.strip().lower() == "false"):
            ctx.warnings.append(
                f"{child_shown}: vLLM-Ascend tests this value for truthiness, so the "
                f"string {_json(given)} turns it on there; pdmesh reads it as false")
        value = read_value(hints[f.name], given, child, child_shown, ctx, track=track)
        if value is _INVALID:
            continue
        expectation = spec.violation(value) if spec else None
        if expectation is not None:
            ctx.problem(child_shown, f"must be {expectation}, got {_json(raw[f.name])}")
            continue
        values[f.name] = value
    return cls(**values)


_INVALID = object()


def read_value(tp: Any, raw: Any, path: str, shown: str, ctx: ReadContext, *,
               track: bool = True) -> Any:
    """``raw`` converted to annotation ``tp``, or ``_INVALID`` after recording a problem."""
    try:
        return _convert(tp, raw, path, shown, ctx, track)
    except _Mismatch as mismatch:
        ctx.problem(shown, f"expected {mismatch.expected}, got {_describe(raw)}")
        return _INVALID


def _convert(tp: Any, raw: Any, path: str, shown: str, ctx: ReadContext, track: bool) -> Any:
    if isinstance(tp, types.UnionType):
        members = [m for m in typing.get_args(tp) if m is not type(None)]
        if raw is None:
            return None
        if len(members) != 1:
            raise TypeError(f"schema union {tp} is not T | None")
        try:
            return _convert(members[0], raw, path, shown, ctx, track)
        except _Mismatch as mismatch:
            raise _Mismatch(f"{mismatch.expected} or null") from None
    if is_dataclass(tp):
        if raw is None:  # a null section: its defaults (vLLM-Ascend reads `x or {}`)
            return read_section(tp, {}, path, shown, ctx, track=track)
        if not isinstance(raw, Mapping):
            raise _Mismatch("an object")
        return read_section(tp, raw, path, shown, ctx, track=track)
    origin = typing.get_origin(tp)
    if origin is tuple:
        return _convert_list(typing.get_args(tp)[0], raw, path, shown, ctx, track)
    if origin is dict:
        if not isinstance(raw, Mapping):
            raise _Mismatch("an object")
        return dict(raw)
    return _convert_scalar(tp, raw, shown, ctx)


def _convert_list(item: Any, raw: Any, path: str, shown: str, ctx: ReadContext,
                  track: bool) -> tuple[Any, ...]:
    if not isinstance(raw, (list, tuple)):
        raise _Mismatch(f"a list of {_NAMES[item].removeprefix('a ').removeprefix('an ')}s")
    items = [read_value(item, v, f"{path}[{i}]", f"{shown}[{i}]", ctx, track=track)
             for i, v in enumerate(raw)]
    return tuple(v for v in items if v is not _INVALID)


_NAMES = {bool: "a boolean (true or false)", int: "an integer", float: "a number",
          str: "a string"}


def _convert_scalar(tp: Any, raw: Any, shown: str, ctx: ReadContext) -> Any:
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
            value = raw.strip().lower() == "true"
            ctx.warnings.append(
                f"{shown}: the string {_json(raw)} was read as the boolean {_json(value)}; "
                f"write {_json(value)} without quotes")
            return value
    elif tp is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
    elif tp is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            if math.isfinite(raw):
                return float(raw)
            raise _Mismatch("a finite number")
    elif tp is str:
        if isinstance(raw, str):
            return raw
    else:
        raise TypeError(f"unsupported schema type {tp!r} at {shown}")
    raise _Mismatch(_NAMES[tp])


def _cast(tp: Any, raw: Any, shown: str, ctx: ReadContext) -> Any:
    """``raw`` as vLLM-Ascend's int() / float() / bool() reads it, where that differs
    from the plain JSON reading and the cast succeeds (else ``raw``, for the usual
    error). Booleans are never numbers here, and bool() takes only numbers: vLLM-Ascend's
    bool("no") is true, which no one means."""
    value: Any = raw
    try:
        if isinstance(raw, bool) or raw is None:
            return raw
        if tp is int and not isinstance(raw, int):
            value = int(raw)  # "256" -> 256, 256.7 -> 256; "256.7" is refused
        elif tp is float and isinstance(raw, str):
            value = float(raw)
        elif tp is bool and isinstance(raw, (int, float)):
            value = bool(raw)
        else:
            return raw
    except (TypeError, ValueError, OverflowError):
        return raw
    if tp is float and not math.isfinite(value):
        return raw
    ctx.warnings.append(f"{shown}: {_json(raw)} was read as {_json(value)}, as vLLM-Ascend "
                        f"casts it; write {_json(value)}")
    return value


def _unknown_key_message(root: type, cls: type, key: str, path: str) -> str:
    suggestion = suggest_key(root, cls, key, path)
    where = f"in {path}" if path else "at the top level"
    message = f"unknown key {where}"
    return f"{message}; did you mean {suggestion}?" if suggestion else message


def suggest_key(root: type, cls: type, key: str, path: str) -> str | None:
    """The full dotted path the user most likely meant by ``key`` found in section ``cls``
    at ``path`` of the schema rooted at ``root``.

    Tried in order: a very close spelling here, the same name at one other place in the
    schema (a misplaced key), a close spelling here, a close spelling anywhere.
    """
    root_index = _schema_index(root)
    prefix = f"{path}." if path else ""
    here = [f.name for f in schema_fields(cls)]
    close = difflib.get_close_matches(key, here, n=1, cutoff=0.8)
    if close:
        return prefix + close[0]
    if len(root_index.get(key, ())) == 1:
        return root_index[key][0]
    close = difflib.get_close_matches(key, here, n=1)
    if close:
        return prefix + close[0]
    close = [k for k in difflib.get_close_matches(key, list(root_index), n=3)
             if len(root_index[k]) == 1]
    return root_index[close[0]][0] if close else None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _schema_index(root: type) -> dict[str, list[str]]:
    """Every key name in the schema tree -> the full dotted paths where it lives."""
    index: dict[str, list[str]] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = _hints(cls)
        for f in schema_fields(cls):
            full = prefix + f.name
            index.setdefault(f.name, []).append(full)
            if is_dataclass(hints[f.name]):
                walk(hints[f.name], full + ".")

    walk(root, "")
    return index


def field_type(root: type, path: str) -> Any:
    """The annotation of the key at dotted ``path`` in the schema rooted at ``root``."""
    tp: Any = root
    for name in path.split("."):
        tp = _hints(tp)[name]
    return tp


def _json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


def _describe(value: Any) -> str:
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): ""}
    kind = next((name for t, name in kinds.items() if type(value) is t),
                "list" if isinstance(value, (list, tuple))
                else "object" if isinstance(value, Mapping) else type(value).__name__)
    return f"{kind} {_json(value)}".strip()
