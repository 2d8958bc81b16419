"""What locking the mesh down costs: `pdmesh up` plain ("off"), with a cluster secret
("secret": every internal gRPC call carrying and checking the token, every registry entry
signed and verified) and with the secret and mutual TLS on every internal gRPC
connection ("mtls", as compose and the k8s manifests run it); `pdmesh bench serve` at
concurrency 1 and at rate inf against each, the arms in A B C C B A order per round in
one run (the machine is shared and noisy). Beside throughput, each load reports the CPU
seconds the mesh's processes spent on it, summed by role (gateway, the edges, the engines,
the rest): that measure does not move with what else the machine is doing.

    .venv/bin/python scripts/bench_cluster_auth.py --model /tmp/bench/qwen3 \\
        [--rounds 1] [--arms off,secret,mtls] [--out auth.json]
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
ARMS = ("off", "secret", "mtls")


def up(model: str, arm: str, logs: str) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PDMESH_CLUSTER", "PDMESH_TLS"))}
    if arm in ("secret", "mtls"):
        env["PDMESH_CLUSTER_SECRET"] = SECRET
    if arm == "mtls":
        from pdmesh.shared.infra import tls

        folder = Path(logs) / "tls"
        tls.write(folder)
        env["PDMESH_TLS_DIR"] = str(folder)
    return start_pdmesh("up", model, Path(logs), env)


def _processes() -> dict[int, tuple[int, str, float]]:
    """pid -> (parent pid, command line, CPU seconds) of every process."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        found[int(pid)] = (int(fields[1]), cmd, (int(fields[11]) + int(fields[12])) / tick)
    return found


def _role(cmd: str) -> str:
    for role in ("prefill", "decode"):
        if f"services.{role}.edge" in cmd:
            return f"{role} edge"
        if f" pdmesh {role} " in cmd:
            return f"{role} engine"
    return "gateway" if " pdmesh gateway " in cmd else "other"


def cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds so far of ``root`` and every process under it, summed by role."""
    procs = _processes()
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, (parent, _, _) in procs.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    totals: dict[str, float] = {}
    for pid in tree & procs.keys():
        role = _role(procs[pid][1])
        totals[role] = totals.get(role, 0.0) + procs[pid][2]
    return totals


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
    p.add_argument("--rounds", type=int, default=1, help="A B C C B A blocks")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--loads", default=",".join(LOADS), help=f"some of {', '.join(LOADS)}")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    arms = a.arms.split(",")
    if not arms or set(arms) - set(ARMS):
        p.error(f"--arms: some of {', '.join(ARMS)}")
    loads = {name: LOADS[name] for name in a.loads.split(",") if name in LOADS}
    if not loads:
        p.error(f"--loads: some of {', '.join(LOADS)}")
    results: dict[str, dict[str, list[dict]]] = {arm: {} for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for arm in (arms + arms[::-1]):
                proc, url = up(a.model, arm, tmp)
                try:
                    for name, load in loads.items():
                        before = cpu_by_role(proc.pid)
                        got = bench(url, a.model, load, os.path.join(tmp, "b.json"))
                        if got["failed"]:
                            raise RuntimeError(f"{arm} {name}: {got['errors']}")
                        after = cpu_by_role(proc.pid)
                        got["cpu_s"] = {k: after[k] - before.get(k, 0.0) for k in after}
                        results[arm].setdefault(name, []).append(got)
                        print(f"round {r} {arm:6s} {name:8s} "
                              f"{got['output_tok_s']:8.1f} tok/s  TPOT p50 "
                              f"{got['tpot_ms_median']:6.2f} ms  TTFT p50 "
                              f"{got['ttft_ms_median']:7.1f} ms  CPU s "
                              + " ".join(f"{k} {v:.2f}" for k, v in sorted(got["cpu_s"].items())),
                              flush=True)
                finally:
                    stop(proc)
    summary: dict[str, dict[str, dict[str, float]]] = {}
    base = arms[0]
    for name in loads:
        for arm in arms:
            runs = results[arm][name]
            tok_s = statistics.median(x["output_tok_s"] for x in runs)
            summary.setdefault(name, {})[arm] = {
                "tok_s": tok_s, "tpot_ms": statistics.median(x["tpot_ms_median"] for x in runs),
                "ttft_ms": statistics.median(x["ttft_ms_median"] for x in runs),
                "cpu_s": statistics.median(sum(x["cpu_s"].values()) for x in runs)}
        for arm in arms:
            row = summary[name][arm]
            row["ratio"] = row["tok_s"] / summary[name][base]["tok_s"]
            print(f"{name:8s} {arm:6s} {row['tok_s']:8.1f} tok/s ({row['ratio']:.3f}x {base})  "
                  f"TPOT p50 {row['tpot_ms']:.2f} ms  TTFT p50 {row['ttft_ms']:.1f} ms  "
                  f"CPU {row['cpu_s']:.2f} s ({row['cpu_s'] / summary[name][base]['cpu_s']:.3f}x)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"summary": summary, "runs": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
