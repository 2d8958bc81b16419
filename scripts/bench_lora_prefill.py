"""What LoRA adapters cost a prefill: the same prompts computed (one output token each,
no prefix cache) by the base model alone, by an engine with LoRA on whose requests run no
adapter, and with each prompt running its own adapter.

    .venv/bin/python scripts/bench_lora_prefill.py --model DIR [--prompts 8]
        [--input-len 1024] [--rank 16] [--runs 3]

The adapters are random, rank --rank, on all seven projections (bench_lora.py's
``write_adapter``); --max-num-batched-tokens 2048. Prints each case's median wall time
over --runs (the cases in turn) and its ratio to the base model's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdmesh.shared.engine import LLM, LoRARequest, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora import write_adapter  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-lora-prefill-"))
    loras = [LoRARequest(f"a{i}", i + 1, str(write_adapter(Path(a.model), work / f"a{i}",
                                                            a.rank, i)))
             for i in range(a.prompts)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 4000, (a.input_len,), generator=g).tolist()
               for _ in range(a.prompts)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    common = {"device": "cpu", "dtype": "float32", "enable_prefix_caching": False,
              "max_num_batched_tokens": 2048}
    base = LLM(a.model, **common)
    lora = LLM(a.model, enable_lora=True, max_loras=a.prompts, max_lora_rank=a.rank,
               **common)
    cases = {"base model": lambda: base.generate(prompts, one),
             "LoRA on, no adapter": lambda: lora.generate(prompts, one),
             f"{a.prompts} adapters": lambda: lora.generate(prompts, one, lora_request=loras)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.runs):
        for name, run in cases.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    ref = statistics.median(times["base model"])
    for name, ts in times.items():
        print(f"{name}: {statistics.median(ts):.2f} s, {statistics.median(ts) / ref:.2f}x")


if __name__ == "__main__":
    main()
