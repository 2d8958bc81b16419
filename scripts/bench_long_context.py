"""Decode time per token against context length: tiny DeepSeek-V4 (sliding window +
compressed sparse attention) next to a dense-attention tiny Qwen3 of the same width, in
one process, interleaved run by run so a noisy machine hurts both alike.

    .venv/bin/python scripts/bench_long_context.py [--contexts 256,1024,4096] [--runs 3]

Each figure: one request alone, its prompt prefilled, then the median time of
``--steps`` decode steps (greedy); the median over ``--runs`` runs is reported. The V4
model has window 128, CSA rate 4 (indexer top-64) and HCA rate 128 (issue 12's shape);
both models get max_position_embeddings raised to fit the longest context.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdmesh.shared.cli.bench.offline import workload
from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.models.tiny import DeepSeekV4Shape, make_tiny_model
from pdmesh.shared.models.tiny_tokenizer import DSV4_TOKENS, train_tokenizer

V4_SHAPE = DeepSeekV4Shape(window=128, csa_rate=4, hca_rate=128, index_topk=64)


def make_models(root: Path, max_len: int) -> dict[str, Path]:
    tok = train_tokenizer(4096)
    paths = {
        "DeepSeek-V4 tiny": make_tiny_model(root / "v4", "deepseek_v4",
                                            tokenizer=train_tokenizer(4096, DSV4_TOKENS),
                                            deepseek_v4=V4_SHAPE),
        "Qwen3 tiny (dense)": make_tiny_model(root / "qwen3", "qwen3", tokenizer=tok),
    }
    for path in paths.values():
        cfg_path = path / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["max_position_embeddings"] = max_len
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return paths


def decode_step_ms(llm: LLM, prompt: list[int], steps: int) -> float:
    eng = llm.engine
    eng.kv.reset_prefix_cache()  # every run pays for its own prefill
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    req = eng.add_request(prompt, params)
    while not req.output_token_ids:  # the prompt, in as many chunks as it takes
        eng.step()
    eng.step()  # the first decode step (its batch shape is new)
    times = []
    while not req.is_finished:
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="256,1024,4096")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json")
    a = p.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    max_len = max(contexts) + a.steps + 64
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_models(Path(tmp), max_len)
        llms = {name: LLM(str(path), device="cpu", dtype=a.dtype, block_size=128,
                          max_model_len=max_len, max_num_seqs=4)
                for name, path in paths.items()}
        corpus = workload(llms["DeepSeek-V4 tiny"].tokenizer, 1, max(contexts))[0]
        for llm in llms.values():  # warm-up
            decode_step_ms(llm, corpus[:contexts[0]], 4)
        runs: dict[str, dict[int, list[float]]] = {n: {c: [] for c in contexts} for n in llms}
        for _ in range(a.runs):
            for ctx in contexts:
                for name, llm in llms.items():
                    runs[name][ctx].append(decode_step_ms(llm, corpus[:ctx], a.steps))
        kv = {name: llm.engine.kv_bytes_per_token for name, llm in llms.items()}
    print(f"torch threads {torch.get_num_threads()}, {a.dtype}, {a.steps} decode steps, "
          f"median of {a.runs} runs")
    print("| model | KV bytes/token | " + " | ".join(f"TPOT @ {c}" for c in contexts)
          + f" | {contexts[-1]} / {contexts[0]} |")
    print("|---|---|" + "---|" * len(contexts) + "---|")
    figures = {}
    for name, per in runs.items():
        med = {c: statistics.median(v) for c, v in per.items()}
        figures[name] = {"kv_bytes_per_token": kv[name], "tpot_ms": med, "runs": per}
        print(f"| {name} | {kv[name]:,} | " + " | ".join(f"{med[c]:.2f} ms" for c in contexts)
              + f" | {med[contexts[-1]] / med[contexts[0]]:.2f}x |")
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
