"""A model folder that is another's but for a JSON file or two: the other's files linked,
the named JSON files rewritten with their fields over the original's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def linked_model(src: Path, dst: Path, **changed: dict[str, Any]) -> Path:
    """``dst`` holding ``src``'s files, each ``name=fields`` (``config={...}``,
    ``generation_config={...}``) written as ``name.json``: ``src``'s fields, then
    ``fields``."""
    dst.mkdir()
    rewritten = {f"{name}.json": fields for name, fields in changed.items()}
    for f in src.iterdir():
        if f.name in rewritten:
            original = json.loads(f.read_text())
            (dst / f.name).write_text(json.dumps({**original, **rewritten[f.name]}))
        else:
            (dst / f.name).symlink_to(f)
    return dst
