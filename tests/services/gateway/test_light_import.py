"""The gateway starts without torch: it reads model configs, tokenizers and grammars,
never tensors, and every mesh start pays for its imports (torch alone is ~2 s of CPU)."""

from __future__ import annotations

import subprocess
import sys


def test_the_gateway_imports_no_torch():
    code = ("import sys, pdmesh.services.gateway.main, pdmesh.services.gateway.app; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "torch" not in out, out
