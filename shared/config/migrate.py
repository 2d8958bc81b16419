"""From what the user gave to one raw tree in today's spelling.

1. ``decode``: the ``--additional-config`` string (or an already-decoded mapping) to a
   dict; invalid JSON is an error naming line, column and character.
2. ``apply_legacy``: moved top-level keys go to their new path, removed keys are checked
   and dropped, environment variables fill keys nobody wrote. Each is a warning naming
   the new spelling; where two sources give one key, the newer spelling wins.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from pdmesh.shared.config.errors import ConfigError, ConfigProblem
from pdmesh.shared.config.legacy import ENV_VARS, MOVED_KEYS, REMOVED_KEYS
from pdmesh.shared.config.reader import ReadContext, field_type, read_value

_FLAG = "--additional-config"
_PYTHON_LOOK = re.compile(r"\b(True|False|None)\b|'|,\s*[}\]]")


def decode(raw: str | Mapping[str, Any]) -> dict[str, Any]:
    """The top-level object, deep-copied so that later steps never touch the caller's."""
    if isinstance(raw, Mapping):
        return copy.deepcopy(dict(raw))
    if not isinstance(raw, str):
        raise ConfigError([ConfigProblem(_FLAG, f"expected a JSON string or a mapping, got "
                                                f"{type(raw).__name__}")])
    duplicates: list[str] = []
    try:
        value = json.loads(raw, object_pairs_hook=lambda pairs: _no_duplicates(pairs, duplicates),
                           parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        hint = ""
        if _PYTHON_LOOK.search(raw):
            hint = ("; this looks like a Python dict: JSON needs true/false/null, double "
                    "quotes and no trailing commas")
        raise ConfigError([ConfigProblem(
            _FLAG, f"invalid JSON at line {exc.lineno} column {exc.colno} (char {exc.pos}): "
                   f"{exc.msg}{hint}")]) from None
    except ValueError as exc:  # NaN / Infinity, refused by _reject_constant
        raise ConfigError([ConfigProblem(_FLAG, str(exc))]) from None
    if not isinstance(value, dict):
        raise ConfigError([ConfigProblem(_FLAG, f"expected a JSON object, got "
                                                f"{type(value).__name__}")])
    if duplicates:
        raise ConfigError([ConfigProblem(k, "key given twice in one JSON object; JSON keeps "
                                            "only the last, so say it once") for k in duplicates])
    return value


def _no_duplicates(pairs: list[tuple[str, Any]], duplicates: list[str]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            duplicates.append(key)
        seen[key] = value
    return seen


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def apply_legacy(tree: dict[str, Any], env: Mapping[str, str], root: type,
                 ctx: ReadContext) -> set[str]:
    """Rewrite ``tree`` into today's spelling in place; returns the removed keys given.

    Warnings and problems go to ``ctx``; ``ctx.shown`` learns how to name moved and
    environment-fed keys in messages.
    """
    for old, new in MOVED_KEYS.items():
        if old in tree:
            _move(tree, old, new, root, ctx)
    removed = set()
    for key in [k for k in tree if k in REMOVED_KEYS]:
        value = tree.pop(key)
        removed.add(key)
        ctx.warnings.append(f"{key}: removed from vLLM-Ascend, ignored; {REMOVED_KEYS[key].hint}")
        read_value(REMOVED_KEYS[key].expected, value, key, key, ctx, track=False)
    for var, target in ENV_VARS.items():
        if var in env:
            _apply_env(tree, var, env[var], target.key, target.parse, ctx)
    return removed


def _move(tree: dict[str, Any], old: str, new: str, root: type, ctx: ReadContext) -> None:
    value = tree.pop(old)
    if _has(tree, new):
        ctx.warnings.append(f"{old}: deprecated, and ignored because {new} is also set "
                            f"({new} wins)")
        # Still checked: a typo inside an ignored legacy object is an error too.
        read_value(field_type(root, new), value, new, old, ctx, track=False)
        return
    ctx.warnings.append(f"{old}: deprecated top-level key; write it as {new}")
    if _put(tree, new, value):
        ctx.shown[new] = old


def _apply_env(tree: dict[str, Any], var: str, text: str, key: str,
               parse: Callable[[str], Any], ctx: ReadContext) -> None:
    try:
        value = parse(text)
    except ValueError as exc:
        ctx.problem(f"{key} (from ${var})", f"{exc}, got {text!r}")
        return
    spelled = json.dumps(value)
    if _has(tree, key):
        ctx.warnings.append(f"${var}: deprecated and ignored because --additional-config sets "
                            f"{key} (the additional-config value wins)")
        return
    ctx.warnings.append(f"${var}: deprecated environment variable; write {key} = {spelled} in "
                        f"--additional-config instead")
    if _put(tree, key, value):
        ctx.shown[key] = f"{key} (from ${var})"


def _has(tree: Mapping[str, Any], path: str) -> bool:
    node: Any = tree
    for name in path.split("."):
        if not isinstance(node, Mapping) or name not in node:
            return False
        node = node[name]
    return True


def _put(tree: dict[str, Any], path: str, value: Any) -> bool:
    """Set ``path`` in ``tree``, creating objects on the way; False when a non-object is in
    the way (the reader reports that one)."""
    *parents, last = path.split(".")
    node = tree
    for name in parents:
        child = node.setdefault(name, {})
        if not isinstance(child, dict):
            return False
        node = child
    node[last] = value
    return True
