"""The decode step's cost at given batch sizes: wall time per step, the model's forward
in it, and the rest (scheduling, inputs, sampling, bookkeeping: the engine's Python).

    python scripts/profile_decode_step.py MODEL [--batch 1 64] [--steps 200]
        [--threads 1] [--profile] [--compile]

``--profile`` prints the functions that took the most time; ``--compile`` times the same
steps with the forward compiled by ``torch.compile`` (inductor, dynamic shapes) to see
whether graph capture pays on this machine (the CPU analogue of the ACL graph mode).
Steps after the prompts are in, every request decoding one token per step, greedy.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from pdmesh.shared.engine import EngineConfig, SamplingParams, build_engine


def measure(model: str, batch: int, steps: int, compiled: bool, profile: bool) -> None:
    eng = build_engine(EngineConfig(model=model, device="cpu"))
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for i in range(batch):
        eng.add_request([10 + (i * 7 + j) % 500 for j in range(64)], params)
    while eng.scheduler.waiting or any(r.num_computed_tokens < 64
                                       for r in eng.scheduler.running):
        eng.step()
    forward = eng.model.forward
    if compiled:  # inductor cannot trace under inference_mode: the plain function, no_grad
        plain = type(eng.model).forward.__wrapped__.__get__(eng.model)
        forward = torch.compile(torch.no_grad()(plain), dynamic=True)
    spent = [0.0]

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = forward(*args, **kwargs)
        spent[0] += time.perf_counter() - t
        return out

    eng.model.forward = timed
    for _ in range(10):  # warm up (and compile)
        eng.step()
    spent[0] = 0.0
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = (time.perf_counter() - t0) / steps
    if prof:
        prof.disable()
    fwd = spent[0] / steps
    print(f"batch {batch:3d}{' compiled' if compiled else ''}: step {wall * 1e3:.3f} ms, "
          f"forward {fwd * 1e3:.3f} ms, the rest {(wall - fwd) * 1e3:.3f} ms "
          f"({(wall - fwd) / wall:.0%})", flush=True)
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
        print(out.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="torch threads (pdmesh up on 2 "
                   "cores gives each engine 1)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    for batch in a.batch:
        measure(a.model, batch, a.steps, False, a.profile)
        if a.compile:
            measure(a.model, batch, a.steps, True, False)


if __name__ == "__main__":
    main()
