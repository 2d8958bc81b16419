"""The cpu backend's paged decode-attention kernel alone (cpu_ops.c's pdmesh_paged_decode,
through CPUBackend._paged_decode): nanoseconds per key row (one token's K and V of one KV
head) over random caches, blocks in random order, several layers' caches so the rows
come from memory as in an engine step. Several builds of the kernel side by side,
interleaved in one process (e.g. an earlier commit's ``cpu_ops.c`` built with
``gcc -O3 -fPIC -shared -fopenmp -ffp-contract=off``), the first the reference for the
outputs' largest difference.

    python scripts/bench_decode_kernel.py [--libs A.so,B.so] [--shape 8x2x32]
        [--batch 64] [--context 1000] [--layers 4] [--cache float32] [--threads 1]

``--shape``: query heads x KV heads x head dim; ``--cache``: float32, bfloat16,
float16 or int8 (with per-token scales).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np
import torch

from pdmesh.shared.kernels.base import AttentionMetadata
from pdmesh.shared.kernels.cpu import CPUBackend
from pdmesh.shared.kernels.cpu_ops import PagedDecodeArgs

CACHES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int8": torch.int8}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--libs", default="", help="kernel builds (.so), comma-separated; "
                                               "default: the installed one")
    ap.add_argument("--shape", default="8x2x32")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--cache", default="float32", choices=CACHES)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    h, kvh, d = map(int, a.shape.split("x"))
    be = CPUBackend(torch.device("cpu"))
    if not be._paged:
        raise SystemExit("this build has no C paged decode kernel (cpu_ops.c)")
    libs = {"installed": be._ops}
    for path in filter(None, a.libs.split(",")):
        lib = ctypes.CDLL(path)
        lib.pdmesh_paged_decode.argtypes = [ctypes.POINTER(PagedDecodeArgs)]
        lib.pdmesh_paged_decode.restype = ctypes.c_int
        libs[path] = lib
    if a.libs:
        del libs["installed"]
    g = torch.Generator().manual_seed(0)
    bs, b, dtype = a.block_size, a.batch, CACHES[a.cache]
    per_seq = -(-a.context // bs)
    blocks = b * per_seq + 1

    def cache() -> torch.Tensor:
        x = torch.randn(blocks, bs, kvh, d, generator=g)
        return (x * 20).to(dtype) if dtype == torch.int8 else x.to(dtype)

    layers = [(cache(), cache()) for _ in range(a.layers)]
    scales = None if dtype != torch.int8 else tuple(
        torch.rand(blocks, bs, kvh, 1, generator=g) * 0.05 for _ in range(2))
    tables = 1 + torch.randperm(blocks - 1, generator=g)[:b * per_seq].view(b, per_seq)
    lens = np.array([a.context - (i * 13) % max(1, a.context // 5) for i in range(b)],
                    dtype=np.int32)
    q = torch.randn(b, h, d, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(b, dtype=torch.int64),
        query_start_loc=torch.arange(b + 1, dtype=torch.int32),
        seq_lens=torch.from_numpy(lens), context_lens=torch.from_numpy(lens - 1),
        block_tables=tables.int(), query_lens_host=[1] * b, seq_lens_host=lens.tolist(),
        context_lens_host=(lens - 1).tolist(), max_query_len=1,
        max_seq_len=int(lens.max()), block_size=bs,
        block_tables_host=tables.int().numpy())
    times: dict[str, list[float]] = {name: [] for name in libs}
    outs: dict[str, torch.Tensor] = {}
    for _ in range(a.rounds):
        for name, lib in libs.items():
            be._ops = lib
            for k, v in layers:  # (warm: the round's first pass)
                be._paged_decode(q, k, v, meta, d ** -0.5, scales=scales)
            t0 = time.perf_counter()
            for _ in range(10):
                for k, v in layers:
                    outs[name] = be._paged_decode(q, k, v, meta, d ** -0.5, scales=scales)
            times[name].append((time.perf_counter() - t0) / (10 * a.layers))
    rows = int(lens.sum()) * kvh
    first = next(iter(outs.values()))
    print(f"{b} sequences x ~{a.context} keys, {h} heads / {kvh} KV heads x {d}, "
          f"{a.cache} cache, {a.layers} layers, {a.threads} thread(s):")
    for name, ts in times.items():
        best, med = min(ts), statistics.median(ts)
        print(f"  {name}: {best * 1e3:.2f} ms a layer (median {med * 1e3:.2f}), "
              f"{best / rows * 1e9:.1f} ns a key row, outputs within "
              f"{float((outs[name] - first).abs().max()):.1e} of the first")


if __name__ == "__main__":
    main()
