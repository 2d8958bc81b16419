"""`pdmesh selftest`: the device's kernels against the reference and a tiny model through
PD on it, as a table (here on the cpu; on the npu backend through the torch_npu stand-in;
and a broken kernel is reported, not passed)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from pdmesh.shared.cli import selftest
from tests.shared.kernels.npu_standin import npu_backend


def test_selftest_on_the_cpu_passes_every_case_and_serves_through_pd(tmp_path):
    out = tmp_path / "selftest.json"
    run = subprocess.run([sys.executable, "-m", "pdmesh", "selftest", "--device", "cpu",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert report["environment"]["device"] == "cpu"
    assert {r["status"] for r in rows} == {"ok"}
    cases = {r["case"] for r in rows}
    assert {"attention decode", "attention prefill (context)", "int8_linear (W8A8 dynamic)",
            "pd end to end, prompt 0", "pd end to end, prompt 1"} <= cases
    assert "of" in run.stdout.splitlines()[-1] and "ok" in run.stdout  # (the table)


def test_the_npu_backend_passes_the_kernel_cases_over_the_standin(monkeypatch):
    backend = npu_backend()
    monkeypatch.setattr(selftest, "get_backend", lambda device: backend)
    rows = selftest.kernel_rows("npu", [torch.float32, torch.bfloat16, torch.float16])
    assert [r for r in rows if r.status != "ok"] == []
    assert len(rows) == 31


def test_a_wrong_or_failing_kernel_is_reported(monkeypatch):
    from pdmesh.shared.kernels import get_backend

    backend = get_backend("cpu")
    monkeypatch.setattr(backend, "rms_norm", lambda x, w, eps: x * 1.01)
    monkeypatch.setattr(backend, "silu_and_mul", lambda x, limit=None: 1 / 0)
    monkeypatch.setattr(selftest, "get_backend", lambda device: backend)
    rows = {(r.case, r.dtype): r for r in selftest.kernel_rows("cpu", [torch.float32])}
    assert rows["rms_norm", "float32"].status == "FAIL"
    failed = rows["silu_and_mul", "float32"]
    assert failed.status == "ERROR" and "ZeroDivisionError" in failed.detail
    assert rows["rotary_embedding", "float32"].status == "ok"


def test_decode_graphs_are_checked_on_a_device_that_has_them(tmp_path, monkeypatch):
    """On cuda / npu the selftest decodes from graphs and eagerly and compares the tokens:
    here the npu backend over its torch_npu stand-in, its graphs the graph stand-in
    (tests/shared/engine/graph_standin.py); the cpu itself has none, and no row."""
    import pdmesh.shared.engine.build as engine_build
    import pdmesh.shared.engine.decode_graphs as decode_graphs
    from tests.shared.engine.graph_standin import standin_device

    assert selftest.graph_rows("cpu", tmp_path) == []
    backend = npu_backend()
    monkeypatch.setattr(engine_build, "get_backend", lambda device: backend)
    monkeypatch.setattr(decode_graphs.GraphDevice, "of", staticmethod(
        lambda device: standin_device()))
    [row] = selftest.graph_rows("cpu", tmp_path)
    assert row.status == "ok" and "replayed" in row.detail, row
    # a device whose replays go wrong is reported, not passed
    monkeypatch.setattr(decode_graphs.DecodeGraphs, "_replay",
                        lambda self, captured, meta, b, writes=True, state=None: None)
    [row] = selftest.graph_rows("cpu", tmp_path)
    assert row.status == "FAIL" and "differs from the eager forward" in row.detail, row
