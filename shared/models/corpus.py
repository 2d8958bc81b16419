"""The local text the tiny models learn from: the standard library's own sources (no
download), for the tokenizer and for distilling an MTP head."""

from __future__ import annotations

import glob
import os
import sysconfig

CORPUS_BYTES = 4_000_000


def corpus_files() -> list[str]:
    """The first standard-library modules, in name order, up to CORPUS_BYTES."""
    libdir = sysconfig.get_paths()["stdlib"]
    files, total = [], 0
    for f in sorted(glob.glob(os.path.join(libdir, "*.py"))):
        files.append(f)
        total += os.path.getsize(f)
        if total > CORPUS_BYTES:
            break
    return files
