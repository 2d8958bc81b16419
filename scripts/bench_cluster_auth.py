"""What the cluster secret costs: `pdmesh up` with and without PDMESH_CLUSTER_SECRET
(every internal gRPC call carrying and checking the token, every registry entry signed
and verified), `pdmesh bench serve` at concurrency 1 and at rate inf against each, in
ABBA order in one run (the machine is shared and noisy).

    .venv/bin/python scripts/bench_cluster_auth.py --model /tmp/bench/qwen3 \\
        [--rounds 2] [--out auth.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_scenarios import start_pdmesh, stop  # (this folder: run as a script)

SECRET = "bench-cluster-secret-0123456789abcdef"
LOADS = {"conc1": ["--max-concurrency", "1", "--num-prompts", "24"],
         "rate-inf": ["--num-prompts", "96"]}


def up(model: str, secret: bool, logs: str) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_CLUSTER")}
    if secret:
        env["PDMESH_CLUSTER_SECRET"] = SECRET
    return start_pdmesh("up", model, Path(logs), env)


def bench(url: str, model: str, load: list[str], out: str) -> dict:
    subprocess.run([sys.executable, "-m", "pdmesh", "bench", "serve", "--base-url", url,
                    "--model", "tiny", "--input-len", "128",
                    "--output-len", "128", "--seed", "0", "--no-progress", "--json", out,
                    *load], check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=2, help="ABBA blocks")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    results: dict[str, dict[str, list[dict]]] = {"off": {}, "on": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for mode in (("off", "on", "on", "off") if r % 2 == 0 else ("on", "off", "off", "on")):
                proc, url = up(a.model, mode == "on", tmp)
                try:
                    for name, load in LOADS.items():
                        got = bench(url, a.model, load, os.path.join(tmp, "b.json"))
                        if got["failed"]:
                            raise RuntimeError(f"{mode} {name}: {got['errors']}")
                        results[mode].setdefault(name, []).append(got)
                        print(f"round {r} {mode:3s} {name:8s} "
                              f"{got['output_tok_s']:8.1f} tok/s  TPOT p50 "
                              f"{got['tpot_ms_median']:6.2f} ms  TTFT p50 "
                              f"{got['ttft_ms_median']:7.1f} ms", flush=True)
                finally:
                    stop(proc)
    summary = {}
    for name in LOADS:
        off = [x["output_tok_s"] for x in results["off"][name]]
        on = [x["output_tok_s"] for x in results["on"][name]]
        summary[name] = {"off_tok_s": statistics.median(off), "on_tok_s": statistics.median(on),
                         "ratio": statistics.median(on) / statistics.median(off),
                         "off_tpot_ms": statistics.median(
                             x["tpot_ms_median"] for x in results["off"][name]),
                         "on_tpot_ms": statistics.median(
                             x["tpot_ms_median"] for x in results["on"][name])}
        print(f"{name:8s} off {summary[name]['off_tok_s']:8.1f}  on "
              f"{summary[name]['on_tok_s']:8.1f} tok/s  ({summary[name]['ratio']:.3f}x)  "
              f"TPOT {summary[name]['off_tpot_ms']:.2f} -> {summary[name]['on_tpot_ms']:.2f} ms")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"summary": summary, "runs": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
