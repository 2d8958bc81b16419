"""`pdmesh bench quantization --model M`: one float checkpoint served in float32,
bfloat16 and each quantized scheme (``pdmesh quantize``), in one process, measured in
turns (run k of every variant before run k + 1 of any, so a noisy neighbour hits them
alike):

    decode ms/token   one request alone, after its prefill (the weights-bound case)
    batch tok/s       --batch requests of --input-len in, --output-len out, greedy
    accuracy          first-token logits' cosine with float32's and greedy agreement
                      with float32 over the batch's outputs (token by token, to the first
                      difference)

Ratios are against float32 measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

VARIANTS = ("float32", "bfloat16", "w8a8_dynamic", "w8a8", "w4a8_dynamic", "fp8_block")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a float checkpoint (e.g. make-tiny-model "
                   "--size medium)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--single-output-len", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    p.add_argument("--work-dir", default=None, help="keep the quantized checkpoints here")
    p.add_argument("--json", default=None, help="also write the figures here")


def run(a: argparse.Namespace) -> int:
    from pdmesh.shared.cli.bench.offline import measure_turn, workload
    from pdmesh.shared.cli.quantize import quantize_checkpoint
    from pdmesh.shared.engine import LLM, SamplingParams

    if a.threads:
        torch.set_num_threads(a.threads)
    names = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad or "float32" not in names:
        raise SystemExit(f"--variants: of {', '.join(VARIANTS)}, float32 among them "
                         f"(the baseline); got {a.variants}")
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="pdmesh-bench-quant-"))
    llms: dict[str, Any] = {}
    for v in names:
        folder, dtype, quant = a.model, v if v in ("float32", "bfloat16") else "float32", None
        if v not in ("float32", "bfloat16"):
            folder = str(work / v)
            if not (Path(folder) / "config.json").exists():
                quantize_checkpoint(a.model, folder, v)
            quant = None if v == "fp8_block" else "ascend"
        llms[v] = LLM(folder, device="cpu", dtype=dtype, quantization=quant,
                      kv_cache_memory_bytes=512 << 20, max_num_seqs=max(a.batch, 1))
    prompts = workload(llms["float32"].tokenizer, a.batch, a.input_len)
    batch_params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    single_params = SamplingParams(temperature=0.0, max_tokens=a.single_output_len,
                                   ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}
    first: dict[str, torch.Tensor] = {}
    for v, llm in llms.items():  # warm-up, outputs and first-token logits
        outputs[v] = [o.outputs[0].token_ids for o in llm.generate(prompts, batch_params)]
        first[v] = _first_logits(llm, prompts[:8])
    tpot: dict[str, list[float]] = {v: [] for v in llms}
    tps: dict[str, list[float]] = {v: [] for v in llms}
    for _ in range(a.runs):
        for v, llm in llms.items():
            tok_s, ms = measure_turn(llm, prompts, batch_params, single_params)
            tps[v].append(tok_s)
            tpot[v].append(ms)
    base_tpot = statistics.median(tpot["float32"])
    base_tps = statistics.median(tps["float32"])
    rows = []
    for v in llms:
        agree, total = 0, 0
        for mine, ref in zip(outputs[v], outputs["float32"], strict=True):
            n = next((i for i, (x, y) in enumerate(zip(mine, ref, strict=True)) if x != y),
                     len(ref))
            agree, total = agree + n, total + len(ref)
        cos = torch.nn.functional.cosine_similarity(first[v].double(),
                                                    first["float32"].double(), dim=-1)
        rows.append({"variant": v, "decode_ms_per_token": statistics.median(tpot[v]),
                     "decode_speedup": base_tpot / statistics.median(tpot[v]),
                     "batch_tok_s": statistics.median(tps[v]),
                     "batch_speedup": statistics.median(tps[v]) / base_tps,
                     "first_logits_cosine_min": float(cos.min()),
                     "greedy_agreement": agree / total,
                     "weight_mb": _weight_bytes(llms[v].engine.model) / 1e6})
    print(f"{'variant':14s} {'weights MB':>10s} {'decode ms/tok':>13s} {'x fp32':>6s} "
          f"{'batch tok/s':>11s} {'x fp32':>6s} {'cosine':>8s} {'agree':>6s}")
    for r in rows:
        print(f"{r['variant']:14s} {r['weight_mb']:10.1f} {r['decode_ms_per_token']:13.2f} "
              f"{r['decode_speedup']:6.2f} {r['batch_tok_s']:11.1f} {r['batch_speedup']:6.2f} "
              f"{r['first_logits_cosine_min']:8.5f} {100 * r['greedy_agreement']:5.1f}%")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "threads": torch.get_num_threads(),
                                            "batch": a.batch, "input_len": a.input_len,
                                            "output_len": a.output_len}, indent=2))
    return 0


def _first_logits(llm, prompts: list[list[int]]) -> torch.Tensor:
    from pdmesh.shared.engine import SamplingParams

    with llm.engine.runner.logits_kept() as kept:
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    return kept[0]


def _weight_bytes(model) -> int:
    from pdmesh.shared.cli.bench.offline import _weight_bytes as weights

    return weights(model)
