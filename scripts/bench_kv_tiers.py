"""The KV tiers under an agent workload whose working set is many times the engine's KV:
pdmesh with tiers off, with the host tier (L2), with L2 and the file tier (L3), and, if
given, vLLM's `vllm serve` with the same KV cache, without and with its CPU offloading
(--kv-offloading-size); each started fresh on loopback, loaded by the same client
(`pdmesh bench serve --scenario agent`), stopped by process group, the systems
interleaved within each round.

    .venv/bin/python scripts/bench_kv_tiers.py --model /tmp/bench/medium \\
        [--sessions 64 --turns 8 --kv-tokens 20480 --host-gb 6 --concurrency 4] \\
        [--systems mixed-off,mixed-l2,mixed-l2file,pd-l2file,vllm,vllm-offload] \\
        [--vllm "/tmp/anchor/venv-vllm/bin/python /tmp/anchor/vllm_cli.py serve" \\
         --vllm-env /tmp/anchor/vllm_env.sh] [--rounds 1] [--out results.json]

Every system's engine holds --kv-tokens tokens of KV (pdmesh's --num-kv-blocks, vLLM's
--num-gpu-blocks-override in its block size); the client keeps --concurrency requests
in flight, taking the sessions' turns in arrival order, so between two turns of one
session the others' histories pass through the cache (the box full); or, paced, the
sessions arrive at --rate a second, each asking its turns back to back, and as many run
at once as happen to overlap (``--concurrency 0 --rate 0.25``). ``pd-...`` runs `pdmesh up` (the
tiers and the KV limit on the prefill engine, whose prefix cache the mesh's prompts hit);
``mixed-...`` `pdmesh serve`. The file tier is a fresh directory per start. Prints the
working set against the KV, then per system the medians over rounds and the ratios to
pdmesh with tiers off and to vLLM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pdmesh.shared.cli.bench.scenarios import ScenarioArgs, build

sys.path.insert(0, str(Path(__file__).parent))
from bench_scenarios import start_pdmesh, start_vllm, stop  # noqa: E402

SYSTEMS = ("mixed-off", "mixed-l2", "mixed-l2file", "pd-off", "pd-l2", "pd-l2file", "vllm",
           "vllm-offload")
FIGURES = [("prefix_hit_fraction", "prefix hits"), ("ttft_ms_median", "TTFT p50"),
           ("ttft_ms_p99", "TTFT p99"), ("output_tok_s", "out tok/s"),
           ("request_s", "req/s")]
SEED = 45


def start(system: str, a: argparse.Namespace, logs: Path):
    kind, _, tiers = system.partition("-")
    if kind == "vllm":
        blocks = a.kv_tokens // a.vllm_block_size
        flags = (f" --block-size {a.vllm_block_size} --num-gpu-blocks-override {blocks}"
                 " --enable-prefix-caching --enable-prompt-tokens-details")
        if tiers == "offload":
            flags += f" --kv-offloading-size {a.host_gb} --kv-offloading-backend native"
        return start_vllm(a, a.max_context, flags, logs)
    words = f" --num-kv-blocks {a.kv_tokens // 16} --block-size 16"
    if tiers != "off":
        words += f" --enable-hierarchical-cache --hicache-size {a.host_gb}"
    env = None
    if tiers == "l2file":
        import os

        words += " --hicache-storage-backend file"
        env = {**os.environ,
               "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": tempfile.mkdtemp(dir=logs)}
    if kind == "pd":
        return start_pdmesh("up", a.model, logs, env, flags=("--prefill-args", words.strip()))
    return start_pdmesh("serve", a.model, logs, env, engine_args=words)


def bench(url: str, a: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "pdmesh", "bench", "serve", "--base-url", url, "--model",
           "tiny", "--scenario", "agent", "--num-prompts", str(a.sessions), "--turns",
           str(a.turns), "--max-context", str(a.max_context), "--request-rate", str(a.rate),
           *(["--max-concurrency", str(a.concurrency)] if a.concurrency else []),
           "--seed", str(SEED),
           "--json", str(out), "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if not out.exists():
        raise RuntimeError(f"bench serve failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
    return json.loads(out.read_text())


def working_set(a: argparse.Namespace) -> tuple[int, int, int]:
    """(the sessions' longest prompts summed, every prompt token, turns)."""
    sessions = build(ScenarioArgs("agent", a.sessions, max_context=a.max_context, seed=SEED,
                                  turns=a.turns))
    return (sum(len(s.turns[-1].prompt) for s in sessions),
            sum(len(t.prompt) for s in sessions for t in s.turns),
            sum(len(s.turns) for s in sessions))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--systems", default="mixed-off,mixed-l2,mixed-l2file,vllm,vllm-offload")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--kv-tokens", type=int, default=20480, help="the engine's KV (L1)")
    p.add_argument("--host-gb", type=float, default=6.0, help="L2 / vLLM's offloading size")
    p.add_argument("--concurrency", type=int, default=4,
                   help="requests in flight at most (0: no cap)")
    p.add_argument("--rate", type=float, default=float("inf"),
                   help="sessions a second, Poisson (inf: all at once)")
    p.add_argument("--vllm-block-size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--vllm", default=None)
    p.add_argument("--vllm-env", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    systems = a.systems.split(",")
    for s in systems:
        if s not in SYSTEMS:
            p.error(f"--systems: {s!r} is not one of {', '.join(SYSTEMS)}")
        if s.startswith("vllm") and not a.vllm:
            p.error(f"--systems: {s} needs --vllm")
    ws, prompt_tokens, turns = working_set(a)
    print(f"agent: {a.sessions} sessions, {turns} turns, {prompt_tokens} prompt tokens; "
          f"working set {ws} tokens = {ws / a.kv_tokens:.1f}x the engine's KV "
          f"({a.kv_tokens} tokens)", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="bench-kv-tiers-"))
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(a.rounds):
        for s in systems:
            proc, url = start(s, a, logs)
            try:
                res = bench(url, a, logs / f"{s}-{r}.json")
            finally:
                stop(proc)
            runs[s].append(res)
            print(f"round {r} {s}: " + ", ".join(f"{label} {res.get(key, 0):.3g}"
                                                for key, label in FIGURES)
                  + f", failed {res.get('failed', 0)}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(runs, indent=1))
    print(summary(runs, systems, runs[systems[0]][0].get("prefix_reusable_fraction", 0)))


def summary(runs: dict[str, list[dict]], systems: list[str], ideal: float) -> str:
    med = {s: {k: statistics.median(r.get(k, 0) for r in runs[s]) for k, _ in FIGURES}
           for s in systems}
    lines = [f"ideal prefix hits (every repeated token hit): {100 * ideal:.1f}%", "",
             "| system | " + " | ".join(label for _, label in FIGURES)
             + " | TTFT p50 / its tiers off | TTFT p50 / vLLM |",
             "|---" * (len(FIGURES) + 3) + "|"]
    for s in systems:
        m = med[s]
        cells = [f"{100 * m['prefix_hit_fraction']:.1f}%"]
        cells += [f"{m[k]:.3g}" for k, _ in FIGURES[1:]]
        for ref in (s.split("-")[0] + "-off", "vllm"):  # (its own kind's tiers off)
            ok = ref in med and med[ref]["ttft_ms_median"] > 0
            cells.append(f"{m['ttft_ms_median'] / med[ref]['ttft_ms_median']:.2f}x"
                         if ok else "-")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
