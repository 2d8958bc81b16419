#!/usr/bin/env python3
"""Is torch.compile worth it for a cpu engine's decode? pdmesh's eager decode (its
oneDNN projections) against the same engine whose MLPs and lm_head go through
torch.compile (inductor; plain torch projections, which inductor lowers - the oneDNN op
it cannot, and the whole forward it cannot trace past the attention's host-side plan).
Each: 64 greedy tokens for 1 and 16 prompts, the best of 3, one process per mode.

    .venv/bin/python scripts/bench_cpu_compile.py --model /tmp/bench/qwen3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

RUN = r"""
import sys, time, torch
from pdmesh.shared.engine import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", dtype="bfloat16", block_size=128)
model = llm.engine.model
if sys.argv[2] == "compile":
    model._mlp = torch.compile(model._mlp, dynamic=False)
    model._logits = torch.compile(model._logits, dynamic=False)
for b in (1, 16):
    prompts = [[10 + i, 20 + i, 30 + i] * 20 for i in range(b)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        best = min(best, time.perf_counter() - t)
    print(b, best, flush=True)
"""


def times(model: str, mode: str) -> dict[int, float]:
    env = dict(os.environ)
    if mode == "compile":
        env["PDMESH_CPU_ONEDNN_LINEAR"] = "0"
    out = subprocess.run([sys.executable, "-c", RUN, model, mode], env=env, check=True,
                         capture_output=True, text=True).stdout
    return {int(b): float(t) for b, t in (line.split() for line in out.splitlines())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    a = ap.parse_args()
    eager, compiled = times(a.model, "eager"), times(a.model, "compile")
    for b in sorted(eager):
        print(f"{b:>3} prompts: eager {eager[b]:.3f} s, torch.compile {compiled[b]:.3f} s, "
              f"compile / eager = {compiled[b] / eager[b]:.2f}")


if __name__ == "__main__":
    main()
