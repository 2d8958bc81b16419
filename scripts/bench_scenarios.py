"""The serving scenarios side by side: the PD mesh (`pdmesh up`), the mixed instance
(`pdmesh serve`) and, if given, vLLM's `vllm serve`, each started fresh on loopback,
loaded by the same client (`pdmesh bench serve --scenario ...`), stopped by process
group; systems interleaved within each round so a noisy machine hurts all alike.

    .venv/bin/python scripts/bench_scenarios.py --model /tmp/bench/qwen3 \\
        --scenarios long-mixed,shared-prefix --rounds 2 \\
        --vllm "/tmp/anchor/venv-vllm/bin/python /tmp/anchor/vllm_cli.py serve" \\
        --vllm-env /tmp/anchor/vllm_env.sh --out /tmp/scenarios.json

``pd-ngram`` / ``mixed-ngram`` are `pdmesh up` / `serve` with n-gram speculative
decoding (``NGRAM``) on the engines; ``pd-ngramcap`` the same with vLLM's
``disable_by_batch_size`` at 16 (no drafts while more requests run or wait);
``pd-mtp1`` .. ``pd-mtp3`` with DeepSeek MTP drafting 1..3 tokens (a model with an MTP
layer: `pdmesh make-tiny-model DIR --arch deepseek_v3 --train-mtp`); each with ``fixed``
after it (``pd-mtp1fixed``) drafts k every step (``"adaptive_drafts": false``).

``pd-base`` is `pdmesh up` of another tree (``--base-tree``: a folder holding a
``pdmesh`` package with its ``shared`` and ``services`` inside, e.g. an earlier commit's
snapshot), for before / after comparisons of pdmesh itself.

Prints one markdown table per scenario (median over rounds; ratios to vLLM where run, else
to pd-base where run).
The scenarios' sizes below keep a round of all of them to minutes on a 2-core box.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import zlib
from pathlib import Path

import httpx

from pdmesh.shared.infra.launcher import stop_group
from pdmesh.shared.infra.net import free_port

# scenario -> extra `pdmesh bench serve` arguments (request counts and rates for 2 cores)
# (each paced shape is followed by its saturated variants: the same requests, all at once
# or in bursts - the box full, as users run it)
SIZES = {
    "short-chat": ["--num-prompts", "48", "--request-rate", "4"],
    "long-mixed": ["--num-prompts", "24", "--request-rate", "0.5"],
    "long-mixed-full": ["--num-prompts", "24", "--request-rate", "inf"],
    "long-mixed-burst": ["--num-prompts", "24", "--arrival", "burst", "--burst-size", "8",
                         "--burst-interval-s", "15"],
    "burst": ["--num-prompts", "32", "--burst-size", "16", "--burst-interval-s", "8"],
    "shared-prefix": ["--num-prompts", "32", "--request-rate", "2", "--num-prefixes", "2"],
    "shared-prefix-full": ["--num-prompts", "32", "--request-rate", "inf",
                           "--num-prefixes", "2"],
    "multi-turn": ["--num-prompts", "12", "--request-rate", "0.5"],
    "long-output": ["--num-prompts", "12", "--request-rate", "0.5"],
    # 128 in / 128 out, 64 requests at once
    "random": ["--num-prompts", "64", "--request-rate", "inf"],
    # one request at a time: the decode TPOT speculation is meant to cut
    "conc1": ["--num-prompts", "8", "--request-rate", "inf", "--max-concurrency", "1",
              "--input-len", "256", "--output-len", "128"],
}
# scenarios that are another's with other sizes or arrivals
SCENARIO = {"conc1": "random", "long-mixed-full": "long-mixed",
            "long-mixed-burst": "long-mixed", "shared-prefix-full": "shared-prefix"}
NGRAM = ('{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":1,'
         '"prompt_lookup_max":3}')  # (--engine-args is split as a shell would)
SPEC = {"ngram": NGRAM, "ngramcap": NGRAM[:-1] + ',"disable_by_batch_size":16}',
        **{f"mtp{k}": f'{{"method":"deepseek_mtp","num_speculative_tokens":{k}}}'
           for k in (1, 2, 3)}}
# "...fixed": the same drafting k every step (pdmesh's adaptive draft length off)
SPEC.update({f"{name}fixed": spec[:-1] + ',"adaptive_drafts":false}'
             for name, spec in list(SPEC.items())})
GOODPUT = ["ttft:2000", "tpot:100"]  # DistServe-style chat SLOs, loosened for a CPU
FIGURES = [("output_tok_s", "out tok/s"), ("ttft_ms_median", "TTFT p50"),
           ("ttft_ms_p99", "TTFT p99"), ("tpot_ms_median", "TPOT p50"),
           ("itl_ms_p99", "ITL p99"), ("goodput_request_s", "goodput req/s"),
           ("prefix_hit_fraction", "prefix hits")]


def start(system: str, a: argparse.Namespace, logs: Path) -> tuple[subprocess.Popen, str]:
    """Start one system; (process, base URL) once it answers."""
    if system == "vllm":  # (usage's cached_tokens, as pdmesh's)
        return start_vllm(a, a.max_context, " --enable-prompt-tokens-details", logs)
    if system == "pd-base":
        if not a.base_tree:
            raise ValueError("--base-tree: pd-base needs the tree to run")
        tree = str(Path(a.base_tree).resolve())
        env = {**os.environ, "PYTHONPATH": tree}
        # `python -m` puts the working directory first on sys.path: run from the tree, or
        # a checkout's own pdmesh (the caller's cwd) shadows it
        where = subprocess.run([sys.executable, "-c", "import pdmesh; print(pdmesh.__file__)"],
                               env=env, cwd=tree, capture_output=True, text=True, check=True)
        if not where.stdout.startswith(tree):
            raise ValueError(f"--base-tree: {tree} does not hold the pdmesh package "
                             f"(it resolves to {where.stdout.strip()})")
        return start_pdmesh("up", a.model, logs, env, cwd=tree)
    kind, _, spec = system.partition("-")
    return start_pdmesh({"pd": "up", "mixed": "serve"}[kind], a.model, logs,
                        engine_args=f" --speculative-config '{SPEC[spec]}'" if spec else "")


def start_vllm(a: argparse.Namespace, max_model_len: int, flags: str, logs: Path
               ) -> tuple[subprocess.Popen, str]:
    """`vllm serve` (``a.vllm``, in ``a.vllm_env``) serving ``a.model`` as "tiny" with
    ``flags`` added; (process, base URL) once it answers (its log: logs/vllm.log)."""
    port = free_port()
    env = _sourced(a.vllm_env) if a.vllm_env else dict(os.environ)
    cmd = (f"{a.vllm} {a.model} --host 127.0.0.1 --port {port} --dtype float32 "
           f"--max-model-len {max_model_len} --gpu-memory-utilization 0.1 "
           f"--max-num-seqs 64 --seed 0 --served-model-name tiny{flags}")
    proc = subprocess.Popen(cmd.split(), stdout=open(logs / "vllm.log", "a"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900  # (the first start on a machine compiles)
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"vllm serve never came up (see {logs / 'vllm.log'})")


def start_pdmesh(command: str, model: str, logs: Path, env: dict[str, str] | None = None,
                 engine_args: str = "", cwd: str | None = None, flags: tuple[str, ...] = ()
                 ) -> tuple[subprocess.Popen, str]:
    """`pdmesh up` or `serve` serving ``model`` as "tiny" (``flags`` added to its own,
    ``engine_args`` to the engines'); (process, base URL) once ready."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdmesh", command, str(Path(model).resolve()), "--port", "0",
         "--served-model-name", "tiny", "--registry-prefix",
         f"bench-{uuid.uuid4().hex[:8]}", "--log-dir", str(logs), *flags, "--engine-args",
         "--device cpu --dtype float32" + engine_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=env, cwd=cwd)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if m := re.search(r"mesh ready: (http://\S+)/v1", line):
            return proc, m.group(1)
    stop(proc)
    raise RuntimeError(f"pdmesh {command} never came up (logs in {logs})")


def stop(proc: subprocess.Popen) -> None:
    stop_group(proc)


def _sourced(script: str) -> dict[str, str]:
    """The environment after ``source script``."""
    out = subprocess.run(["bash", "-c", f"source {script} >/dev/null && env -0"],
                         capture_output=True, check=True).stdout
    return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)


def seed_of(scenario: str) -> int:
    """Each scenario's own requests (a variant's the same shapes, other ids): one run
    after another on a server must not find the last one's prompts in its prefix cache."""
    return zlib.crc32(scenario.encode()) % 100_000


def run_scenario(url: str, scenario: str, a: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "pdmesh", "bench", "serve", "--base-url", url, "--model",
           "tiny", "--scenario", SCENARIO.get(scenario, scenario), "--max-context",
           str(a.max_context), "--seed", str(seed_of(scenario)), "--goodput", *GOODPUT,
           "--json", str(out), "--no-progress", *SIZES[scenario]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if not out.exists():
        raise RuntimeError(f"bench serve failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--scenarios", default=",".join(s for s in SIZES if s != "conc1"))
    p.add_argument("--systems", default="pd,mixed,vllm")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--vllm", default=None, help="the `vllm serve` command (without MODEL)")
    p.add_argument("--vllm-env", default=None, help="a script to source for vLLM's env")
    p.add_argument("--base-tree", default=None, help="PYTHONPATH of the pd-base system")
    p.add_argument("--ref", default=None,
                   help="the system the ratios are to (default: vllm, else pd-base)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    scenarios = a.scenarios.split(",")
    systems = [s for s in a.systems.split(",") if s != "vllm" or a.vllm]
    results: dict[str, dict[str, list[dict]]] = {sc: {sy: [] for sy in systems}
                                                  for sc in scenarios}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for system in systems if r % 2 == 0 else systems[::-1]:
                logs = Path(tmp) / f"{system}-{r}"
                logs.mkdir()
                proc, url = start(system, a, logs)
                try:
                    for sc in scenarios:
                        res = run_scenario(url, sc, a, logs / f"{sc}.json")
                        results[sc][system].append(res)
                        print(f"round {r} {system:5s} {sc:13s} {res['output_tok_s']:7.1f} tok/s "
                              f"TTFT p50 {res['ttft_ms_median']:7.0f} TPOT p50 "
                              f"{res['tpot_ms_median']:6.1f} failed {res['failed']}",
                              flush=True)
                finally:
                    stop(proc)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))
    for sc in scenarios:
        print(f"\n### {sc} (median of {a.rounds} round(s); goodput SLO {' '.join(GOODPUT)})\n")
        print("| system | " + " | ".join(label for _, label in FIGURES) + " |")
        print("|---|" + "---|" * len(FIGURES))
        med = {sy: {k: statistics.median(x[k] or 0 for x in runs) for k, _ in FIGURES}
               for sy, runs in results[sc].items() if runs}
        ref = a.ref or ("vllm" if "vllm" in med else "pd-base")
        for sy, figs in med.items():
            cells = []
            for k, _ in FIGURES:
                cell = f"{figs[k]:.0%}" if k.endswith("fraction") else f"{figs[k]:,.1f}"
                if ref in med and sy != ref and med[ref][k]:
                    cell += f" ({figs[k] / med[ref][k]:.2f}x)"
                cells.append(cell)
            print(f"| {sy} | " + " | ".join(cells) + " |")
    summary(results, scenarios, a.ref)


def summary(results: dict[str, dict[str, list[dict]]], scenarios: list[str],
            ref: str | None) -> None:
    """One line per scenario: each system's throughput, TTFT p50 and TPOT p50 to the
    reference's (vLLM where run, else pd-base), paced and saturated shapes one under the
    other."""
    systems = [sy for sy in next(iter(results.values()))]
    ref = ref or ("vllm" if "vllm" in systems else "pd-base")
    others = [sy for sy in systems if sy != ref]
    if ref not in systems or not others:
        return
    keys = ("output_tok_s", "ttft_ms_median", "tpot_ms_median")
    print(f"\n### every scenario: tok/s, TTFT p50 and TPOT p50 to {ref} (medians over "
          f"rounds)\n")
    print("| scenario | " + " | ".join(f"{sy} tok/s | {sy} TTFT | {sy} TPOT"
                                      for sy in others) + " |")
    print("|---|" + "---|" * len(keys) * len(others))
    for sc in scenarios:
        med = {sy: {k: statistics.median(x[k] or 0 for x in runs) for k in keys}
               for sy, runs in results[sc].items() if runs}
        if ref not in med:
            continue
        cells = []
        for sy in others:
            for k in keys:
                cells.append(f"{med[sy][k] / med[ref][k]:.2f}x"
                             if sy in med and med[ref][k] else "-")
        print(f"| {sc} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
