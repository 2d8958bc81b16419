"""The committed stubs are what the protos generate now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_generated_stubs_are_current(tmp_path):
    protos = sorted((ROOT / "shared/proto").glob("*.proto"))
    assert protos
    run = subprocess.run(["bash", str(ROOT / "scripts/gen_proto.sh"), sys.executable,
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    fresh_stubs = sorted(tmp_path.glob("*_pb2*.py*"))
    assert len(fresh_stubs) == 3 * len(protos)
    stale = []
    for fresh in fresh_stubs:
        committed = ROOT / "shared/proto" / fresh.name
        if not committed.is_file() or committed.read_bytes() != fresh.read_bytes():
            stale.append(fresh.name)
    assert not stale, f"stale stubs (run `make proto`): {stale}"
