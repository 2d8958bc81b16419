"""LoRA served: the PD mesh (`pdmesh up`) and, if given, vLLM's `vllm serve`, each serving
the base model alone and with 1, 4 and 16 adapters, loaded by the same client
(`pdmesh bench serve`, each request asking for one of the adapters at random, as
vLLM's bench serve's --lora-modules); every server started fresh on loopback and
stopped by process group, the systems interleaved within each round.

    .venv/bin/python scripts/bench_lora_serve.py [--model DIR] [--rounds 2] \\
        [--vllm "/tmp/anchor/venv-vllm/bin/python /tmp/anchor/vllm_cli.py serve" \\
         --vllm-env /tmp/anchor/vllm_env.sh] [--out results.json]

Without --model it makes the "small" tiny Qwen3 (Qwen3-0.6B's width, 12 layers). The
adapters are random, rank --rank, on q, k, v, o, gate, up and down (scripts/bench_lora.py's
``write_adapter``). Both systems get as many device slots as adapters (--max-loras) and
--max-lora-rank --rank. Loads (``LOADS``): the box full (every request at once) and
paced. Prints, per load, the medians over rounds and the ratios to the same system's
base model and to vLLM with the same adapters.
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
from bench_scenarios import start_pdmesh, start_vllm  # noqa: E402

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
    return start_vllm(a, 2048, flags, logs)


def start_pdmesh_with(a: argparse.Namespace, flags: str, logs: Path
                      ) -> tuple[subprocess.Popen, str]:
    return start_pdmesh("up", a.model, logs, engine_args=" --max-model-len 2048",
                        flags=tuple(flags.split()))


def bench(url: str, n: int, load: str, a: argparse.Namespace, out: Path) -> dict:
    names = ["--lora-modules", *(f"a{i}" for i in range(n))] if n else []
    cmd = [sys.executable, "-m", "pdmesh", "bench", "serve", "--base-url", url, "--model",
           "tiny", "--input-len", str(a.input_len), "--output-len", str(a.output_len),
           "--seed", str(a.seed), "--json", str(out), "--no-progress", *LOADS[load], *names]
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
    p.add_argument("--vllm", default=None, help="the command that starts `vllm serve`")
    p.add_argument("--vllm-env", default=None, help="a script to source for it")
    p.add_argument("--out", default=None)
    a = p.parse_args()
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
            for n in CASES:
                proc, url = systems[system](a, lora_flags(adapters, n, a.rank), work)
                try:
                    for load in LOADS:
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
    summary(runs, list(systems))


def summary(runs: dict[str, list[dict]], systems: list[str]) -> None:
    def med(key: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[key])

    for load in LOADS:
        print(f"\n{load}: {' '.join(LOADS[load])}")
        print("| system | adapters | out tok/s | TPOT p50 ms | TTFT p50 ms | TPOT x base "
              "| tok/s x vLLM |")
        print("|---|---|---|---|---|---|---|")
        for system in systems:
            for n in CASES:
                key, base = f"{system}/{n}/{load}", f"{system}/0/{load}"
                tput, tpot = med(key, "output_tok_s"), med(key, "tpot_ms_median")
                vs = (f"{tput / med(f'vllm/{n}/{load}', 'output_tok_s'):.2f}x"
                      if "vllm" in systems else "")
                print(f"| {system} | {n or 'none'} | {tput:.1f} | {tpot:.1f} | "
                      f"{med(key, 'ttft_ms_median'):.0f} | "
                      f"{tpot / med(base, 'tpot_ms_median'):.2f}x | {vs} |")


if __name__ == "__main__":
    main()
