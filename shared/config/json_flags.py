"""Command-line flags whose value is a JSON object (--kv-transfer-config, ...)."""

from __future__ import annotations

import json
from typing import Any


def json_flag(flag: str, text: str | None) -> dict[str, Any]:
    """A flag holding a JSON object; ValueError naming the flag otherwise."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: invalid JSON at line {e.lineno} column {e.colno}: "
                         f"{e.msg}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: must be a JSON object")
    return value
