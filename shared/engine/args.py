"""Engine flags for every command line, spelled as ``vllm serve`` spells them."""

from __future__ import annotations

import argparse

from pdmesh.shared.engine.config import EngineConfig
from pdmesh.shared.kernels import DEVICES


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", required=True, help="Hugging Face-style model folder")
    g.add_argument("--device", default="auto", choices=DEVICES)
    g.add_argument("--dtype", default="auto",
                   help="auto (the checkpoint's), float32, bfloat16 or float16")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--block-size", type=int, default=128)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)
    g.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority"))
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache size in blocks (overrides the memory-based sizing)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV cache size in bytes (CPU default: up to 1 GiB)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model, device=a.device, dtype=a.dtype, seed=a.seed, block_size=a.block_size,
        max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        enable_prefix_caching=a.enable_prefix_caching, scheduling_policy=a.scheduling_policy,
        num_kv_blocks=a.num_kv_blocks, kv_cache_memory_bytes=a.kv_cache_memory_bytes,
        gpu_memory_utilization=a.gpu_memory_utilization,
    )

