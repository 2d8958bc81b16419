"""`pdmesh bench tensor-parallel --model M`: one checkpoint at TP 1 and at TP N in one
process (rank 0 here, N - 1 workers beside it), measured in turns (run k of both before
run k + 1 of either, so a noisy neighbour hits them alike):

    decode ms/token   one request alone, after its prefill (the weights-bound case)
    batch tok/s       --batch requests of --input-len in, --output-len out, greedy
    weights MB        what rank 0 holds (each worker reports its own at start-up)
    step split        where rank 0's decode step goes at TP N: the inputs' broadcast to
                      the workers, the layers' all-reduces, the logits' all-gather, and
                      the rest (its own compute, and waiting for nothing else); time in
                      a collective includes waiting there for the slowest rank

TP 1 runs with ``--threads`` torch threads (default: every core), each TP N rank with
``--threads // N``. Ratios are against TP 1 measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a checkpoint (e.g. make-tiny-model "
                   "--size medium)")
    p.add_argument("--tp", type=int, default=2, help="the tensor-parallel size to compare")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--single-output-len", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="cores in all (0: every core)")
    p.add_argument("--json", default=None, help="also write the figures here")


def run(a: argparse.Namespace) -> int:
    from pdmesh.shared.cli.bench.offline import measure_turn, workload
    from pdmesh.shared.engine import LLM, SamplingParams
    from pdmesh.shared.models.transformer import weight_bytes

    if a.tp < 2:
        raise SystemExit(f"--tp: must be >= 2 (compared with TP 1), got {a.tp}")
    cores = a.threads or os.cpu_count() or 1
    threads = {1: cores, a.tp: max(1, cores // a.tp)}
    kw = dict(device="cpu", dtype=a.dtype, kv_cache_memory_bytes=512 << 20,
              max_num_seqs=max(a.batch, 1))
    llms = {1: LLM(a.model, **kw), a.tp: LLM(a.model, tensor_parallel_size=a.tp, **kw)}
    try:
        prompts = workload(llms[1].tokenizer, a.batch, a.input_len)
        batch = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
        single = SamplingParams(temperature=0.0, max_tokens=a.single_output_len,
                                ignore_eos=True)
        outputs = {}
        for tp, llm in llms.items():  # warm-up, and the outputs compared
            torch.set_num_threads(threads[tp])
            outputs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, batch)]
        tpot: dict[int, list[float]] = {tp: [] for tp in llms}
        tps: dict[int, list[float]] = {tp: [] for tp in llms}
        split: list[dict[str, float]] = []
        for _ in range(a.runs):
            for tp, llm in llms.items():
                torch.set_num_threads(threads[tp])
                clock = _Clock(llm.engine)
                tok_s, ms = measure_turn(llm, prompts, batch, single, clock)
                tps[tp].append(tok_s)
                tpot[tp].append(ms)
                if llm.engine.tp_ranks is not None:
                    split.append(clock.shares)
        rows = []
        for tp, llm in llms.items():
            rows.append({"tp": tp, "threads_per_rank": threads[tp],
                         "decode_ms_per_token": statistics.median(tpot[tp]),
                         "decode_vs_tp1": statistics.median(tpot[1]) / statistics.median(
                             tpot[tp]),
                         "batch_tok_s": statistics.median(tps[tp]),
                         "batch_vs_tp1": statistics.median(tps[tp]) / statistics.median(
                             tps[1]),
                         "rank0_weight_mb": weight_bytes(llm.engine.model.w) / 1e6,
                         "same_outputs": outputs[tp] == outputs[1]})
        shares = {k: statistics.median(s.get(k, 0.0) for s in split)
                  for k in ("broadcast", "all_reduce", "gather_logits")}
        shares["compute_and_rest"] = 1.0 - sum(shares.values())
        print(f"{'TP':>3s} {'threads':>7s} {'rank-0 MB':>9s} {'decode ms/tok':>13s} "
              f"{'x TP1':>6s} {'batch tok/s':>11s} {'x TP1':>6s} same")
        for r in rows:
            print(f"{r['tp']:3d} {r['threads_per_rank']:7d} {r['rank0_weight_mb']:9.1f} "
                  f"{r['decode_ms_per_token']:13.2f} {r['decode_vs_tp1']:6.2f} "
                  f"{r['batch_tok_s']:11.1f} {r['batch_vs_tp1']:6.2f} {r['same_outputs']}")
        ms = statistics.median(tpot[a.tp])
        print(f"TP{a.tp} decode step ({ms:.2f} ms/token): " + ", ".join(
            f"{k} {100 * v:.0f}% ({v * ms:.2f} ms)" for k, v in shares.items()))
        if a.json:
            Path(a.json).write_text(json.dumps({"rows": rows, "decode_step_split": shares,
                                                "batch": a.batch, "input_len": a.input_len,
                                                "output_len": a.output_len}, indent=2))
    finally:
        llms[a.tp].close()
    return 0


class _Clock:
    """Around a TP engine's decode steps: the share of their time each kind of
    collective took on rank 0 (``shares``); nothing for a TP1 engine."""

    def __init__(self, engine):
        self.engine = engine
        self.seconds: dict[str, float] = {}
        self.shares: dict[str, float] = {}

    def __enter__(self):
        if self.engine.tp_ranks is not None:
            self.engine.model.tp.clock = self.engine.tp_ranks.clock = self.seconds
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        took = time.perf_counter() - self.t0
        if self.engine.tp_ranks is not None:
            self.engine.model.tp.clock = self.engine.tp_ranks.clock = None
        self.shares = {k: v / took for k, v in self.seconds.items()}
