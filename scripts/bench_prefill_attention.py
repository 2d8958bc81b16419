"""The cpu backend's prefill attention, the C kernel over the cache in place (cpu_ops.c's
pdmesh_paged_prefill) against the torch path it replaces (each sequence's keys sliced or
gathered, torch's SDPA with a causal mask), one layer's call over random caches with
blocks in random order, interleaved rounds: milliseconds a call and their ratio.

    python scripts/bench_prefill_attention.py [--context 1700,0] [--queries 2048,512]
        [--shape 8x2x32] [--block-size 16] [--cache float32] [--threads 1]

``--context`` / ``--queries``: each sequence's cached keys and the queries it computes
this step (a fresh prompt has context 0); ``--shape``: query heads x KV heads x head dim.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pdmesh.shared.kernels.base import AttentionMetadata
from pdmesh.shared.kernels.cpu import CPUBackend

CACHES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="1700")
    ap.add_argument("--queries", default="2048")
    ap.add_argument("--shape", default="8x2x32")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cache", default="float32", choices=CACHES)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    h, kvh, d = map(int, a.shape.split("x"))
    ctx = np.array([int(x) for x in a.context.split(",")], dtype=np.int64)
    qlens = np.array([int(x) for x in a.queries.split(",")], dtype=np.int64)
    if len(ctx) != len(qlens):
        raise SystemExit("--context and --queries list the same sequences")
    be = CPUBackend(torch.device("cpu"))
    if not be._paged_prefill:
        raise SystemExit("no C paged prefill kernel here (cpu_ops.c: not built, or a CPU "
                         "without AVX-512)")
    g = torch.Generator().manual_seed(0)
    bs, dtype = a.block_size, CACHES[a.cache]
    lens = ctx + qlens
    per_seq = -(-lens // bs)
    blocks = int(per_seq.sum()) + 1
    order = (1 + torch.randperm(blocks - 1, generator=g)).numpy()
    tables = np.zeros((len(lens), int(per_seq.max())), dtype=np.int32)
    ends = np.cumsum(per_seq)
    for i, (lo, hi) in enumerate(zip(ends - per_seq, ends, strict=True)):
        tables[i, :hi - lo] = order[lo:hi]
    k_cache, v_cache = (torch.randn(blocks, bs, kvh, d, generator=g).to(dtype)
                        for _ in range(2))
    pos = np.concatenate([np.arange(c, n) for c, n in zip(ctx, lens, strict=True)])
    seq = np.repeat(np.arange(len(lens)), qlens)
    slots = tables[seq, pos // bs].astype(np.int64) * bs + pos % bs
    t = int(qlens.sum())
    q = torch.randn(t, h, d, generator=g).to(dtype)
    # this step's keys and values: already in the caches, as an engine step writes them
    k, v = (c.view(-1, kvh, d)[torch.from_numpy(slots)] for c in (k_cache, v_cache))
    qsl = np.concatenate(([0], np.cumsum(qlens))).astype(np.int32)

    def meta() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(slots), query_start_loc=torch.from_numpy(qsl),
            seq_lens=torch.from_numpy(lens.astype(np.int32)),
            context_lens=torch.from_numpy(ctx.astype(np.int32)),
            block_tables=torch.from_numpy(tables), query_lens_host=qlens.tolist(),
            seq_lens_host=lens.tolist(), context_lens_host=ctx.tolist(),
            max_query_len=int(qlens.max()), max_seq_len=int(lens.max()), block_size=bs,
            block_tables_host=tables)

    times: dict[str, list[float]] = {"torch": [], "kernel": []}
    outs: dict[str, torch.Tensor] = {}
    for _ in range(a.rounds):
        for path in times:
            be._paged_prefill = path == "kernel"
            t0 = time.perf_counter()
            m = meta()  # (the plan is a step's, shared by its layers: timed once here)
            be.prepare_attention(m)
            outs[path] = be.paged_attention_prefill(q, k, v, k_cache, v_cache, m, d ** -0.5)
            times[path].append(time.perf_counter() - t0)
    best = {path: min(ts) * 1e3 for path, ts in times.items()}
    print(f"context {a.context} / queries {a.queries}, {h} heads / {kvh} KV heads x {d}, "
          f"{a.cache} cache, block {bs}, {a.threads} thread(s): torch {best['torch']:.1f} ms, "
          f"kernel {best['kernel']:.1f} ms, kernel / torch "
          f"{best['kernel'] / best['torch']:.2f}, outputs within "
          f"{float((outs['kernel'].double() - outs['torch'].double()).abs().max()):.1e}")


if __name__ == "__main__":
    main()
