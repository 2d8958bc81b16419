"""What LoRA adapters cost a decode step: the same batch decoded by the base model alone,
by an engine with LoRA on whose requests run no adapter, and with 1, 4 and 16 adapters
(each request one of them, round robin; as many device slots as adapters).

    .venv/bin/python scripts/bench_lora.py [--model DIR] [--rank 16] [--requests 16]
        [--input-len 128] [--output-len 64] [--runs 3] [--modules all|qv]

Without --model it makes the "small" tiny Qwen3 (Qwen3-0.6B's width, 12 layers). The
adapters are random, rank --rank, on q, k, v, o, gate, up and down (--modules all) or
on q and v (qv) (PEFT's format, written here). TPOT is the decode time (a run's wall
time less its prefill-only run's) over the output tokens less one; the figure is the
median of --runs, each case run in turn so that the machine's drift falls on all alike.
Ratios are against the base model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdmesh.shared.engine import LLM, LoRARequest, SamplingParams

MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def write_adapter(model: Path, out: Path, rank: int, seed: int,
                  modules: tuple[str, ...] = MODULES) -> Path:
    """A random PEFT-format adapter of ``rank`` on ``modules`` of every decoder layer."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module.split("layers.")[-1].split(".", 1)[-1] \
                    in modules:
                n_out, n_in = f.get_slice(name).get_shape()
                tensors[f"base_model.model.{module}.lora_A.weight"] = \
                    torch.randn(rank, n_in, generator=gen) / n_in ** 0.5
                tensors[f"base_model.model.{module}.lora_B.weight"] = \
                    torch.randn(n_out, rank, generator=gen) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [m.split(".")[-1] for m in modules]}))
    return out


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts, params, lora_request=loras)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modules", choices=("all", "qv"), default="all")
    a = p.parse_args()
    modules = MODULES if a.modules == "all" else ("self_attn.q_proj", "self_attn.v_proj")
    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    model = Path(a.model) if a.model else work / "model"
    if a.model is None:
        from pdmesh.shared.models.tiny import make_tiny_model

        make_tiny_model(model, "qwen3", seed=0, size="small")
    adapters = [write_adapter(model, work / f"a{i}", a.rank, i, modules) for i in range(16)]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 4000, (a.input_len,), generator=gen).tolist()
               for _ in range(a.requests)]
    decode = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    common = dict(device="cpu", dtype="float32", block_size=16, enable_prefix_caching=False)
    cases = {"base model": (LLM(str(model), **common), None)}
    for n in (0, 1, 4, 16):
        llm = LLM(str(model), enable_lora=True, max_loras=max(n, 1), max_lora_rank=a.rank,
                  **common)
        loras = None if n == 0 else [LoRARequest(f"a{i % n}", i % n + 1, str(adapters[i % n]))
                                     for i in range(a.requests)]
        cases["LoRA on, no adapter" if n == 0 else f"{n} adapters"] = (llm, loras)
    tpot: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(a.runs):
        for name, (llm, loras) in cases.items():
            whole = timed(llm, prompts, decode, loras)
            first = timed(llm, prompts, prefill, loras)
            tpot[name].append((whole - first) / (a.output_len - 1))
    base = statistics.median(tpot["base model"])
    print(f"{a.requests} requests, {a.input_len} prompt + {a.output_len} output tokens, "
          f"rank {a.rank} on {a.modules}, {torch.get_num_threads()} threads; TPOT median of "
          f"{a.runs}")
    print("case | TPOT ms | x base")
    for name, values in tpot.items():
        median = statistics.median(values)
        print(f"{name} | {median * 1000:.1f} | {median / base:.2f}")


if __name__ == "__main__":
    main()
