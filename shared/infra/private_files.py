"""Files only their owner may read: the cluster secret, a TLS key."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path, data: bytes, mode: int = 0o600) -> None:
    """``data`` into ``path``, readable by its owner alone (``mode``); a folder made for
    it is the owner's alone (0700). The services that read it run as one user (root in
    the images)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # (a file that was there keeps its mode otherwise)
        f.write(data)
