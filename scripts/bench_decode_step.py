"""The decode step alone, pdmesh's engine against vLLM's, each in its own process on the
same model: B requests with prompts of L tokens (random ids, new ones each round, so no
prefix hits), stepped until every one has its first token, then S steps timed one by one
while all B decode (contexts L .. L + S). Each step is the engine's whole step:
scheduling, the forward, sampling, bookkeeping (vLLM: ``LLMEngine.step()`` with its engine
core in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Rounds alternate between the two
engines, each started once, so a noisy machine hurts both alike.

    .venv/bin/python scripts/bench_decode_step.py /tmp/bench/qwen3 --batch 64 \\
        --context 1000 --steps 32 --rounds 3 --threads 2 \\
        --vllm /tmp/anchor/venv-vllm/bin/python --vllm-env /tmp/anchor/vllm_env.sh

Prints each round's median step (ms) and the ratio pdmesh / vLLM of the medians over the
rounds, and the cores each process kept busy while stepping. ``--threads``: both
engines' threads (``OMP_NUM_THREADS`` for every OpenMP runtime in either process: vLLM's
kernels run on their own besides torch's ``set_num_threads``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

MARK = "@@bench "  # the child's answers (its engine may print to stdout too)


def prompts(seed: int, batch: int, context: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(context)] for _ in range(batch)]


def timed_steps(step, steps: int) -> list[float]:
    """Each step's wall time; the last entry: the cores the process kept busy meanwhile
    (its CPU time over the wall time of all of them)."""
    times = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times + [(time.process_time() - cpu0) / (time.perf_counter() - wall0)]


class PdmeshSide:
    """pdmesh's engine in this process."""

    def __init__(self, a: argparse.Namespace) -> None:
        import torch

        from pdmesh.shared.engine import EngineConfig, SamplingParams, build_engine
        torch.set_num_threads(a.threads)
        self.engine = build_engine(EngineConfig(
            model=a.model, device="cpu", max_num_seqs=max(a.batch, 1),
            max_model_len=a.context + a.steps + 16))
        self.vocab = self.engine.model_config.vocab_size
        self.params = SamplingParams(temperature=0, max_tokens=a.steps + 8, ignore_eos=True)

    def round(self, ids: list[list[int]], steps: int) -> list[float]:
        eng = self.engine
        reqs = [eng.add_request(p, self.params) for p in ids]
        while any(r.num_output_tokens < 1 for r in reqs):
            eng.step()
        times = timed_steps(eng.step, steps)
        for r in reqs:
            eng.abort(r.request_id)
        while eng.has_unfinished():
            eng.step()
        return times


class VllmSide:
    """vLLM's engine in this process (run under vLLM's python)."""

    def __init__(self, a: argparse.Namespace) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM, SamplingParams
        self.llm = LLM(model=a.model, dtype="float32", seed=0, max_num_seqs=max(a.batch, 1),
                       max_model_len=a.context + a.steps + 16, gpu_memory_utilization=0.1)
        self.engine = self.llm.llm_engine
        self.vocab = self.engine.model_config.get_vocab_size()
        self.params = SamplingParams(temperature=0, max_tokens=a.steps + 8, ignore_eos=True)
        self.n = 0

    def round(self, ids: list[list[int]], steps: int) -> list[float]:
        eng = self.engine
        rids = []
        for p in ids:
            self.n += 1
            rids.append(f"r{self.n}")
            eng.add_request(rids[-1], {"prompt_token_ids": p}, self.params)
        started: set[str] = set()
        while len(started) < len(rids):
            for out in eng.step():
                if out.outputs and out.outputs[0].token_ids:
                    started.add(out.request_id)
        times = timed_steps(eng.step, steps)
        eng.abort_request(rids)
        while eng.has_unfinished_requests():
            eng.step()
        return times


def serve(a: argparse.Namespace) -> None:
    """The child: one engine, a round per line read ("SEED"), a JSON line of step times
    written back."""
    side = VllmSide(a) if a.system == "vllm" else PdmeshSide(a)
    print(MARK + json.dumps({"vocab": side.vocab}), flush=True)
    for line in sys.stdin:
        seed = int(line)
        times = side.round(prompts(seed, a.batch, a.context, side.vocab), a.steps)
        print(MARK + json.dumps({"times": times}), flush=True)


def child(a: argparse.Namespace, system: str, python: str, env: dict[str, str]):
    args = [python, os.path.abspath(__file__), a.model, "--system", system, "--child",
            "--batch", str(a.batch), "--context", str(a.context), "--steps", str(a.steps),
            "--threads", str(a.threads)]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    if reply(proc) is None:
        proc.wait()
        raise SystemExit(f"{system}: its engine did not start (exit {proc.returncode})")
    return proc


def ask(proc: subprocess.Popen, seed: int) -> list[float]:
    proc.stdin.write(f"{seed}\n")
    proc.stdin.flush()
    answer = reply(proc)
    if answer is None:
        raise SystemExit("an engine died mid-round")
    return answer["times"]  # (the last: cores busy)


def reply(proc: subprocess.Popen) -> dict | None:
    """The child's next answer (other lines passed on to stderr); None once it ended."""
    for line in proc.stdout:
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
        sys.stderr.write(line)
    return None


def sourced(script: str) -> dict[str, str]:
    out = subprocess.run(["bash", "-c", f"source {script} && env -0"], check=True,
                         capture_output=True).stdout
    return dict(kv.split("=", 1) for kv in out.decode().split("\0") if "=" in kv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vllm", default="", help="vLLM's python; without it pdmesh alone")
    ap.add_argument("--vllm-env", default="", help="a script to source for vLLM's run")
    ap.add_argument("--system", default="pdmesh", choices=["pdmesh", "vllm"])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    for name in ("batch", "context", "steps", "rounds", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if a.child:
        return serve(a)
    # every OpenMP runtime in either process (vLLM's kernels bring their own) to the
    # same thread count
    threads = {"OMP_NUM_THREADS": str(a.threads)}
    systems = {"pdmesh": child(a, "pdmesh", sys.executable, {**os.environ, **threads})}
    if a.vllm:
        env = sourced(a.vllm_env) if a.vllm_env else dict(os.environ)
        systems["vllm"] = child(a, "vllm", a.vllm, {**env, **threads})
    medians: dict[str, list[float]] = {name: [] for name in systems}
    try:
        for r in range(a.rounds):
            for name, proc in systems.items():
                *times, cores = ask(proc, 1000 + r)
                medians[name].append(statistics.median(times) * 1e3)
                print(f"round {r + 1} {name}: median {medians[name][-1]:.2f} ms, "
                      f"min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}, "
                      f"{cores:.2f} cores busy", flush=True)
    finally:
        for proc in systems.values():
            proc.kill()
    mid = {name: statistics.median(m) for name, m in medians.items()}
    line = ", ".join(f"{name} {m:.2f} ms" for name, m in mid.items())
    print(f"batch {a.batch} x {a.context} tokens, {a.threads} thread(s): {line}"
          + (f"; pdmesh / vLLM {mid['pdmesh'] / mid['vllm']:.2f}" if "vllm" in mid else ""))


if __name__ == "__main__":
    main()
