"""`pdmesh bench offline`: the engine against transformers' generate(), in one process.

Workload (the issues' figures): N prompts x L token ids in (cut from standard-library
source text), M out, greedy, EOS ignored; then one request alone for time to first token
and time per output token. Each figure is the median of ``--runs`` timed runs (at least
5 for the single request) after one warm-up, and transformers runs the same token ids
right after, so the ratio compares like with like on a shared, noisy machine.
"""

from __future__ import annotations

import json
import os
import statistics
import sysconfig
import time
from dataclasses import asdict
from typing import Any

import torch

MEM_BANDWIDTH_GBS = 45.0  # this kind of machine, measured (../shared/baselines)
SINGLE_RUNS = 5  # the single request is short, so its median takes more runs


def workload(tokenizer: Any, num_prompts: int, input_len: int) -> list[list[int]]:
    libdir = sysconfig.get_paths()["stdlib"]
    ids: list[int] = []
    for name in ("argparse.py", "dataclasses.py", "functools.py", "inspect.py", "typing.py",
                 "pathlib.py", "subprocess.py", "threading.py"):
        with open(os.path.join(libdir, name)) as f:
            ids += tokenizer.encode(f.read(), add_special_tokens=False)
    step = len(ids) // num_prompts
    if step < input_len:
        raise ValueError(f"input_len: corpus too small for {num_prompts} x {input_len}")
    return [ids[i * step:i * step + input_len] for i in range(num_prompts)]


def measure_turn(llm: Any, prompts: list[list[int]], batch: Any, single: Any,
                 decoding: Any = None) -> tuple[float, float]:
    """One turn of a benchmark that compares engines: the batch (output tok/s) and one
    request alone (ms per decoded token, after its prefill), each from a cold prefix
    cache. ``decoding``: a context manager around the lone request's decode steps."""
    import contextlib

    eng = llm.engine
    eng.kv.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate(prompts, batch)
    tok_s = len(prompts) * batch.max_tokens / (time.perf_counter() - t0)
    eng.kv.reset_prefix_cache()
    req = eng.add_request(prompts[0], single)
    eng.step()
    with decoding or contextlib.nullcontext():
        t0 = time.perf_counter()
        while not req.is_finished:
            eng.step()
        took = time.perf_counter() - t0
    return tok_s, took / (single.max_tokens - 1) * 1e3


def _median_runs(fn, runs: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def bench_pdmesh(a: Any, prompts: list[list[int]]) -> dict[str, Any]:
    from pdmesh.shared.config.engine_config import engine_config
    from pdmesh.shared.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**asdict(engine_config(a.flags)))
    ready = time.perf_counter() - t0
    eng = llm.engine
    batch_params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    outputs: list[list[int]] = []

    def batch() -> None:
        eng.kv.reset_prefix_cache()  # every run pays for its prefill
        outs = llm.generate(prompts, batch_params)
        outputs[:] = [o.outputs[0].token_ids for o in outs]

    t_batch, batch_runs = _median_runs(batch, a.runs)

    def single() -> tuple[float, float]:
        eng.kv.reset_prefix_cache()
        req = eng.add_request(prompts[0], batch_params)
        t0 = time.perf_counter()
        eng.step()
        ttft = time.perf_counter() - t0
        while not req.is_finished:
            eng.step()
        total = time.perf_counter() - t0
        return ttft, (total - ttft) / (a.output_len - 1)

    single()
    singles = [single() for _ in range(max(SINGLE_RUNS, a.runs))]
    return {
        "ready_s": ready,
        "batch_tok_s": len(prompts) * a.output_len / t_batch,
        "batch_runs_tok_s": [len(prompts) * a.output_len / t for t in batch_runs],
        "ttft_ms": 1e3 * statistics.median(s[0] for s in singles),
        "tpot_ms": 1e3 * statistics.median(s[1] for s in singles),
        "outputs": outputs,
        "weight_bytes": _weight_bytes(eng.model),
        "device": eng.device,
        "dtype": str(eng.dtype).removeprefix("torch."),
    }


def _weight_bytes(model: Any) -> int:
    """Bytes a decode step reads: every weight the forward uses (walked through the
    weights' dataclasses; MTP layers are not the forward's), less the embedding table
    (one row of it)."""
    from pdmesh.shared.models.transformer import weight_tensors

    w = model.w
    return sum(t.numel() * t.element_size() for t in weight_tensors(w, frozenset({"mtp"}))
               if t is not w.embed or w.lm_head is w.embed)


def bench_transformers(a: Any, prompts: list[list[int]], dtype: torch.dtype
                       ) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).eval()
    kw = dict(do_sample=False, max_new_tokens=a.output_len, min_new_tokens=a.output_len,
              pad_token_id=model.config.eos_token_id)
    ids = torch.tensor(prompts)
    out: list[torch.Tensor] = []

    def batch() -> None:
        with torch.inference_mode():
            out[:] = [model.generate(ids, attention_mask=torch.ones_like(ids), **kw)]

    t_batch, batch_runs = _median_runs(batch, a.runs)
    one = ids[:1]

    def run(n: int) -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(one, attention_mask=torch.ones_like(one), do_sample=False,
                           max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=model.config.eos_token_id)
            return time.perf_counter() - t0

    run(a.output_len)
    ttft = statistics.median(run(1) for _ in range(max(SINGLE_RUNS, a.runs)))
    total = statistics.median(run(a.output_len) for _ in range(max(SINGLE_RUNS, a.runs)))
    return {
        "batch_tok_s": len(prompts) * a.output_len / t_batch,
        "batch_runs_tok_s": [len(prompts) * a.output_len / t for t in batch_runs],
        "ttft_ms": 1e3 * ttft,
        "tpot_ms": 1e3 * (total - ttft) / (a.output_len - 1),
        "outputs": out[0][:, ids.shape[1]:].tolist(),
    }


def run(a: Any) -> int:
    from pdmesh.shared.models.tokenizer import Tokenizer

    prompts = workload(Tokenizer(a.model), a.num_prompts, a.input_len)
    print(f"workload: {a.num_prompts} prompts x {a.input_len} tokens in, {a.output_len} out, "
          f"greedy, eos ignored; torch threads {torch.get_num_threads()}", flush=True)
    ours = bench_pdmesh(a, prompts)
    bound_ms = ours["weight_bytes"] / (MEM_BANDWIDTH_GBS * 1e9) * 1e3
    print(f"pdmesh        ready {ours['ready_s']:.2f}s | batch {ours['batch_tok_s']:8.0f} tok/s "
          f"| single TTFT {ours['ttft_ms']:6.2f} ms, TPOT {ours['tpot_ms']:6.3f} ms", flush=True)
    print(f"  decode bound: {ours['weight_bytes'] / 1e6:.1f} MB of weights per token at "
          f"{MEM_BANDWIDTH_GBS:.0f} GB/s = {bound_ms:.3f} ms; TPOT is "
          f"{ours['tpot_ms'] / bound_ms:.1f}x the bound")
    result: dict[str, Any] = {"pdmesh": ours, "decode_bound_ms": bound_ms,
                              "args": a.flags.values()}
    if not a.no_hf:
        dtype = getattr(torch, ours["dtype"])
        hf = bench_transformers(a, prompts, dtype)
        exact = sum(x == y for x, y in zip(ours["outputs"], hf["outputs"], strict=True))
        print(f"transformers  batch {hf['batch_tok_s']:8.0f} tok/s | single TTFT "
              f"{hf['ttft_ms']:6.2f} ms, TPOT {hf['tpot_ms']:6.3f} ms")
        speedup = ours["batch_tok_s"] / hf["batch_tok_s"]
        print(f"ratio pdmesh/transformers: batch throughput {speedup:.2f}x, "
              f"TPOT {hf['tpot_ms'] / ours['tpot_ms']:.2f}x faster, TTFT "
              f"{hf['ttft_ms'] / ours['ttft_ms']:.2f}x faster; greedy outputs identical "
              f"{exact}/{len(prompts)}")
        result["transformers"] = hf
        result["identical_outputs"] = exact
    if a.json:
        for side in ("pdmesh", "transformers"):
            result.get(side, {}).pop("outputs", None)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
