"""Decode steps with the cpu backend's C paged-attention kernel against its dense path
(keys gathered, or mirrored, into [B, KVH, L, D] for torch's SDPA), in one engine,
interleaved rounds: the step time of each and their ratio.

    python scripts/bench_decode_attention.py MODEL [--batch 64] [--context 800]
        [--steps 20] [--kv-cache-dtype auto] [--dtype float32] [--threads 1]

Prompts of mixed length (context to 1.5 x context), every request then decoding one
token a step, greedy.
"""

from __future__ import annotations

import argparse
import time

import torch

from pdmesh.shared.engine import EngineConfig, SamplingParams, build_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=800)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    eng = build_engine(EngineConfig(model=a.model, device="cpu", dtype=a.dtype,
                                    kv_cache_dtype=a.kv_cache_dtype,
                                    max_num_batched_tokens=8192))
    if not getattr(eng.backend, "_paged", False):
        raise SystemExit("this build has no C paged decode kernel (cpu_ops.c)")
    params = SamplingParams(temperature=0, max_tokens=1 << 30, ignore_eos=True)
    for i in range(a.batch):
        n = a.context + (i * 37) % max(1, a.context // 2)
        eng.add_request([10 + (i * 7 + j) % 500 for j in range(n)], params)
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                       for r in eng.scheduler.running):
        eng.step()
    ms: dict[str, list[float]] = {"dense": [], "kernel": []}
    for _ in range(a.rounds):
        for path in ms:
            eng.backend._paged = path == "kernel"
            for _ in range(3):  # (the dense path's mirror is rebuilt here)
                eng.step()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                eng.step()
            ms[path].append((time.perf_counter() - t0) / a.steps * 1e3)
    best = {path: min(v) for path, v in ms.items()}
    print(f"batch {a.batch}, context {a.context}: decode step dense "
          f"{best['dense']:.2f} ms, kernel {best['kernel']:.2f} ms, kernel / dense "
          f"{best['kernel'] / best['dense']:.2f} (rounds: {ms})")


if __name__ == "__main__":
    main()
