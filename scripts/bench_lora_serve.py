"""LoRA served: the PD mesh (`pdmesh up`) and, if given, vLLM's `vllm serve`, each serving
the base model alone and with 1, 4 and 16 adapters, loaded by the same client
(`pdmesh bench serve`, each request asking for one of the adapters at random, as
vLLM's bench serve's --lora-modules); every server started fresh on loopback and
stopped by process group, the systems interleaved within each round.

    .venv/bin/python scripts/bench_lora_serve.py [--model DIR] [--rounds 2] \\
        [--vllm "/tmp/anchor/venv-vllm/bin/python /tmp/anchor/vllm_cli.py serve" \\
         --vllm-env /tmp/anchor/vllm_env.sh] [--out results.json] \\
        [--scenarios long-mixed,shared-prefix,...] [--cases 0,16]

Without --model it makes the "small" tiny Qwen3 (Qwen3-0.6B's width, 12 layers). The
adapters are random, rank --rank, on q, k, v, o, gate, up and down (scripts/bench_lora.py's
``write_adapter``). Both systems get as many device slots as adapters (--max-loras) and
--max-lora-rank --rank. Loads (``LOADS``): the box full (every request at once) and
paced; or, with --scenarios, scripts/bench_scenarios.py's traffic shapes (long
mixed-length prompts, shared prefixes, long outputs ..., each paced and with the box full),
its sizes and seeds, the model's context --max-context. Prints, per load, the medians
over rounds and the ratios to the same system's base model and to vLLM with the same
adapters.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pdmesh.shared.infra.launcher import stop_group

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora import write_adapter  # noqa: E402
from bench_scenarios import SCENARIO, SIZES, seed_of, start_pdmesh, start_vllm  # noqa: E402

CASES = (0, 1, 4, 16)  # adapters served (0: the base model, LoRA off)
LOADS = {  # name -> `pdmesh bench serve` arguments
    "full": ["--num-prompts", "32", "--request-rate", "inf"],
    "paced": ["--num-prompts", "32", "--request-rate", "2"],
}


def lora_flags(adapters: list[Path], n: int, rank: int) -> str:
    if n == 0:
        return ""
    modules = " ".join(f"a{i}={adapters[i]}" for i in range(n))
    return (f" --enable-lora --lora-modules {modules} --max-loras {n} --max-cpu-loras {n}"
            f" --max-lora-rank {rank}")


def start_vllm_with(a: argparse.Namespace, flags: str, logs: Path
                    ) -> tuple[subprocess.Popen, str]:
    # (usage's cached_tokens, as pdmesh's: the shared-prefix shapes report prefix hits)
    return start_vllm(a, a.max_context, flags + " --enable-prompt-tokens-details", logs)


def start_pdmesh_with(a: argparse.Namespace, flags: str, logs: Path
                      ) -> tuple[subprocess.Popen, str]:
    return start_pdmesh("up", a.model, logs, engine_args=f" --max-model-len {a.max_context}",
                        flags=tuple(flags.split()))


def load_args(load: str, a: argparse.Namespace) -> list[str]:
    """`pdmesh bench serve`'s arguments for ``load``: one of LOADS (random prompts of
    --input-len), or a scenario of scripts/bench_scenarios.py."""
    if load in LOADS:
        return ["--input-len", str(a.input_len), "--output-len", str(a.output_len),
                "--seed", str(a.seed), *LOADS[load]]
    return ["--scenario", SCENARIO.get(load, load), "--max-context", str(a.max_context),
            "--seed", str(seed_of(load)), *SIZES[load]]


def bench(url: str, n: int, load: str, a: argparse.Namespace, out: Path) -> dict:
    names = ["--lora-modules", *(f"a{i}" for i in range(n))] if n else []
    cmd = [sys.executable, "-m", "pdmesh", "bench", "serve", "--base-url", url, "--model",
           "tiny", "--json", str(out), "--no-progress", *load_args(load, a), *names]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if not out.exists():
        raise RuntimeError(f"bench serve failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--first-round", type=int, default=0,
                   help="the first round's number (odd: the systems in reverse order)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scenarios", default=None,
                   help="scripts/bench_scenarios.py's shapes, comma-separated, in place of "
                        "the random prompts' loads")
    p.add_argument("--cases", default=",".join(map(str, CASES)),
                   help="the adapter counts served (0: the base model alone)")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--vllm", default=None, help="the command that starts `vllm serve`")
    p.add_argument("--vllm-env", default=None, help="a script to source for it")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    loads = a.scenarios.split(",") if a.scenarios else list(LOADS)
    cases = [int(n) for n in a.cases.split(",")]
    if bad := [x for x in loads if x not in LOADS and x not in SIZES]:
        p.error(f"--scenarios: unknown {bad} (known: {', '.join(SIZES)})")
    if any(n not in range(17) for n in cases) or 0 not in cases:
        p.error("--cases: adapter counts 0 .. 16, 0 (the base model) among them")
    work = Path(tempfile.mkdtemp(prefix="bench-lora-serve-"))
    if a.model is None:
        from pdmesh.shared.models.tiny import make_tiny_model

        a.model = str(work / "model")
        make_tiny_model(Path(a.model), "qwen3", seed=0, size="small")
    adapters = [write_adapter(Path(a.model), work / f"a{i}", a.rank, i) for i in range(16)]
    systems = {"pd": start_pdmesh_with, **({"vllm": start_vllm_with} if a.vllm else {})}
    runs: dict[str, list[dict]] = {}
    for r in range(a.first_round, a.first_round + a.rounds):
        order = list(systems) if r % 2 == 0 else list(reversed(systems))
        for system in order:
            for n in cases:
                proc, url = systems[system](a, lora_flags(adapters, n, a.rank), work)
                try:
                    for load in loads:
                        key = f"{system}/{n}/{load}"
                        res = bench(url, n, load, a, work / f"{key.replace('/', '-')}-{r}.json")
                        runs.setdefault(key, []).append(res)
                        print(f"round {r} {key}: {res['output_tok_s']:.1f} tok/s, "
                              f"TPOT p50 {res['tpot_ms_median']:.1f} ms, "
                              f"failed {res.get('failed', 0)}", flush=True)
                finally:
                    stop_group(proc)
    if a.out:
        Path(a.out).write_text(json.dumps(runs, indent=1))
    summary(runs, list(systems), loads, cases)


def summary(runs: dict[str, list[dict]], systems: list[str], loads: list[str],
            cases: list[int]) -> None:
    def med(key: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[key])

    for load in loads:
        print(f"\n{load}: {' '.join(LOADS.get(load) or SIZES[load])}")
        print("| system | adapters | out tok/s | TPOT p50 ms | TTFT p50 ms | TPOT x base "
              "| tok/s x vLLM |")
        print("|---|---|---|---|---|---|---|")
        for system in systems:
            for n in cases:
                key, base = f"{system}/{n}/{load}", f"{system}/0/{load}"
                tput, tpot = med(key, "output_tok_s"), med(key, "tpot_ms_median")
                vs = (f"{tput / med(f'vllm/{n}/{load}', 'output_tok_s'):.2f}x"
                      if "vllm" in systems else "")
                print(f"| {system} | {n or 'none'} | {tput:.1f} | {tpot:.1f} | "
                      f"{med(key, 'ttft_ms_median'):.0f} | "
                      f"{tpot / med(base, 'tpot_ms_median'):.2f}x | {vs} |")


if __name__ == "__main__":
    main()
