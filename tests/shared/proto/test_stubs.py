"""The committed stubs are what the protos generate now."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_generated_stubs_are_current(tmp_path):
    protos = sorted((ROOT / "shared/proto").glob("*.proto"))
    assert protos
    work = tmp_path / "shared/proto"
    work.mkdir(parents=True)
    for p in protos:
        shutil.copy(p, work / p.name)
    run = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.",
         "--grpc_python_out=.", "--pyi_out=.", *[f"shared/proto/{p.name}" for p in protos]],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    stale = []
    for fresh in sorted(work.glob("*_pb2*.py*")):
        committed = ROOT / "shared/proto" / fresh.name
        if not committed.is_file() or committed.read_bytes() != fresh.read_bytes():
            stale.append(fresh.name)
    assert not stale, f"stale stubs (run `make proto`): {stale}"
