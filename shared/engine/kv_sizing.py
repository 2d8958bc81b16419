"""How many KV blocks each cache group gets: from the engine's limits and memory budget
(``num_kv_blocks``, ``kv_cache_memory_bytes``, ``gpu_memory_utilization`` of what the
device has left after the weights, or a CPU default), the cache's layout and dtype."""

from __future__ import annotations

import torch

from pdmesh.shared.engine.block_manager import GroupBlocks
from pdmesh.shared.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from pdmesh.shared.engine.kv_cache_spec import FULL, KVCacheSpec


def kv_blocks(cfg: EngineConfig, spec: KVCacheSpec, dtype: torch.dtype, device: str,
              max_model_len: int, max_num_batched_tokens: int) -> list[GroupBlocks]:
    """Blocks per cache group. A sliding group gets what every seat's window needs
    plus a full step of new tokens; the history group (the first) gets the rest of
    the budget, or ``num_kv_blocks``."""
    bs = cfg.block_size
    sliding = {g.name: cfg.max_num_seqs * (-(-g.window // bs) + 2)
               + -(-max_num_batched_tokens // bs)
               for g in spec.groups if g.kind != FULL}
    sliding_bytes = sum(n * g.block_bytes(dtype) for g in spec.groups
                        for n in [sliding.get(g.name, 0)])
    per_block = spec.groups[0].block_bytes(dtype)
    if cfg.num_kv_blocks is not None:
        blocks = cfg.num_kv_blocks
    else:
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif device == "cpu":
            # Enough for every seat at full length, at most the default CPU budget.
            full = cfg.max_num_seqs * max_model_len // bs + cfg.max_num_seqs
            budget = min(DEFAULT_CPU_KV_CACHE_BYTES, full * per_block + sliding_bytes)
        else:
            budget = device_kv_budget(device, cfg.gpu_memory_utilization)
        if not per_block:  # no history tensors (sliding layers only): bookkeeping
            per_block = 1
            budget = cfg.max_num_seqs * (-(-max_model_len // bs) + 1) + sliding_bytes
        blocks = (budget - sliding_bytes) // per_block
        if blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes: {budget} bytes hold no KV block "
                             f"({per_block} bytes each, after {sliding_bytes} bytes of "
                             "sliding-window blocks)")
    return [GroupBlocks(g.name, int(blocks)) if g.kind == FULL
            else GroupBlocks(g.name, sliding[g.name], window=g.window)
            for g in spec.groups]


def device_kv_budget(device: str, gpu_memory_utilization: float) -> int:
    """gpu_memory_utilization of device memory, less what weights already took and a
    reserve for activations."""
    mod = torch.npu if device == "npu" else torch.cuda  # type: ignore[attr-defined]
    free, total = mod.mem_get_info()
    used = total - free
    reserve = int(0.05 * total)
    return max(0, int(total * gpu_memory_utilization) - used - reserve)
