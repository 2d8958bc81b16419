"""What the distribution installs: one top-level package, `pdmesh`, with the engine's
public names at its top (`from pdmesh import LLM, SamplingParams`), and the bind shim."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_installs_pdmesh_and_nothing_else(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel, = tmp_path.glob("pdmesh-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"pdmesh"}
    assert "pdmesh/shared/runtime/protocol.py" in names
    assert "pdmesh/services/gateway/journey.py" in names
    assert any(n.startswith("pdmesh/shared/infra/_bindhost") and n.endswith(".so")
               for n in names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # from the unpacked wheel alone (cwd: not the repository), as a user imports it
    run = subprocess.run([sys.executable, "-c",
                          "import pdmesh, pdmesh.shared.runtime.protocol as p\n"
                          "from pdmesh import LLM, SamplingParams\n"
                          "print(pdmesh.__file__, p.__file__, LLM.__module__, "
                          "SamplingParams(max_tokens=3).max_tokens)"],
                         cwd=site, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    where, protocol, llm_module, max_tokens = run.stdout.split()
    assert where.startswith(str(site)) and protocol.startswith(str(site))
    assert llm_module == "pdmesh.shared.engine.llm" and max_tokens == "3"
