"""The LoRA adapters a command line names: vLLM's ``--lora-modules`` (``name=path`` or
JSON ``{"name", "path", "base_model_name"}``) and SGLang's ``--lora-paths`` (``path``,
``name=path`` or JSON ``{"lora_name", "lora_path", "pinned"}``), as (name, folder) pairs."""

from __future__ import annotations

import json
from typing import Any


def lora_modules(f: Any) -> tuple[tuple[str, str], ...]:
    """Every adapter both flags name, in order; ValueError naming the flag for a word that
    is neither form, or a name given twice."""
    out: list[tuple[str, str]] = []
    for flag, words, keys in (("--lora-modules", getattr(f, "lora_modules", ()) or (),
                               ("name", "path")),
                              ("--lora-paths", getattr(f, "lora_paths", ()) or (),
                               ("lora_name", "lora_path"))):
        for word in words:
            out.append(_one(flag, word, keys))
    names = [n for n, _ in out]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise ValueError(f"--lora-modules: the adapter name {twice!r} is given twice")
    return tuple(out)


def _one(flag: str, word: str, keys: tuple[str, str]) -> tuple[str, str]:
    if word.lstrip().startswith("{"):
        try:
            item = json.loads(word)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag}: {word!r} is not JSON: {e}") from None
        if not isinstance(item, dict) or not all(isinstance(item.get(k), str) and item[k]
                                                 for k in keys):
            raise ValueError(f"{flag}: {word!r} needs {keys[0]!r} and {keys[1]!r}")
        return item[keys[0]], item[keys[1]]
    name, eq, path = word.partition("=")
    if eq:
        if not name or not path:
            raise ValueError(f"{flag}: {word!r}: expected name=path")
        return name, path
    if flag == "--lora-paths":  # (SGLang: a bare path is its own name)
        return word, word
    raise ValueError(f"{flag}: {word!r}: expected name=path or a JSON object")
