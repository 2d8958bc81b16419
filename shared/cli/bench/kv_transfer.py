"""`pdmesh bench kv-transfer`: how fast a prompt's KV moves through the Mooncake pool.

Starts a private ``mooncake_master``, two pool clients (a producer and a consumer, as a
prefill and a decode instance would be), fills a paged cache shaped like the model's,
puts the prompt's blocks from it and gets them into another, checking every byte.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdmesh.shared.models.config import ModelConfig, parse_dtype


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--runs", type=int, default=3)


def run(a: argparse.Namespace) -> int:
    from pdmesh.shared.infra.net import free_port
    from pdmesh.shared.kvpool import CacheRegions
    from pdmesh.shared.kvpool.master import MasterPorts, MasterSupervisor
    from pdmesh.shared.kvpool.mooncake import MooncakePool

    cfg = ModelConfig.from_folder(a.model)
    dtype = parse_dtype(a.dtype)
    n = -(-a.tokens // a.block_size)
    # the model's own cache layout (K and V, or MLA's latent), plus the null block
    shape = (n + 1, a.block_size, cfg.kv_cache_heads, cfg.kv_cache_dim)
    src = [tuple(torch.randn(shape).to(dtype) for _ in range(cfg.kv_cache_tensors))
           for _ in range(cfg.num_layers)]
    dst = [tuple(torch.zeros(shape, dtype=dtype) for _ in range(cfg.kv_cache_tensors))
           for _ in range(cfg.num_layers)]
    s_regions, d_regions = CacheRegions(src), CacheRegions(dst)
    total = s_regions.value_bytes * n
    ports = MasterPorts("127.0.0.1", free_port(), free_port(), free_port())
    sup = MasterSupervisor(ports)
    sup.start()
    puts, gets = [], []
    try:
        producer = MooncakePool(ports.master_address, ports.metadata_url,
                                segment_bytes=(a.runs + 1) * total + (64 << 20))
        consumer = MooncakePool(ports.master_address, ports.metadata_url,
                                segment_bytes=64 << 20)
        try:
            for t in s_regions.tensors:
                producer.register(t)
            for t in d_regions.tensors:
                consumer.register(t)
            for r in range(a.runs):
                keys = [f"bench{r}/{b}" for b in range(n)]
                t0 = time.perf_counter()
                ok_put = producer.put(keys, [s_regions.regions(b + 1) for b in range(n)])
                t1 = time.perf_counter()
                ok_get = consumer.get(keys, [d_regions.regions(b + 1) for b in range(n)])
                t2 = time.perf_counter()
                if not (all(ok_put) and all(ok_get)):
                    raise RuntimeError(f"run {r}: the pool refused or lost blocks")
                for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
                    if not (torch.equal(sk[1:], dk[1:]) and torch.equal(sv[1:], dv[1:])):
                        raise RuntimeError(f"run {r}: blocks differ after the round trip")
                    dk.zero_()
                    dv.zero_()
                puts.append(total / (t1 - t0) / 1e9)
                gets.append(total / (t2 - t1) / 1e9)
        finally:
            consumer.close()
            producer.close()
    finally:
        sup.stop()
    print(f"{a.tokens} tokens = {n} blocks = {total / 1e6:.0f} MB of KV ({cfg.num_layers} "
          f"layers, {str(dtype).removeprefix('torch.')}): put median "
          f"{statistics.median(puts):.2f} GB/s {[round(x, 2) for x in puts]}, get median "
          f"{statistics.median(gets):.2f} GB/s {[round(x, 2) for x in gets]}")
    return 0
