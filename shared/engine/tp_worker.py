"""A tensor-parallel worker rank (> 0): the process rank 0's engine starts beside itself,
holding its shard of the model and of the paged cache and running the steps rank 0 hands
it (pdmesh.shared.parallel.tensor_parallel)."""

from __future__ import annotations

import torch

from pdmesh.shared.engine.config import EngineConfig
from pdmesh.shared.engine.kv_cache_spec import allocate_caches, cache_spec, layer_caches
from pdmesh.shared.engine.model_runner import ModelRunner
from pdmesh.shared.kernels import get_backend, resolve_device
from pdmesh.shared.models.config import ModelConfig, parse_dtype
from pdmesh.shared.models.loader import load_model


class TensorParallelWorker:
    """A tensor-parallel rank > 0: its shard of the model and of the paged cache (as many
    blocks as rank 0's), running the steps rank 0 hands it."""

    def __init__(self, config: EngineConfig, rank: int, size: int, address: str):
        from pdmesh.shared.parallel.expert_parallel import dist_backend
        from pdmesh.shared.parallel.tensor_parallel import Shard, init, receive

        device = resolve_device(config.device)
        backend = get_backend(device)
        init(rank, size, address, dist_backend(device))
        torch.manual_seed(config.seed)
        model_cfg = ModelConfig.from_folder(config.model)
        dtype = parse_dtype(config.dtype, default=model_cfg.dtype)
        _, model = load_model(config.model, backend, dtype, model_cfg, config.quantization,
                              shard=Shard(rank, size))
        spec = cache_spec(model.config, config.block_size,
                          int8=config.kv_cache_dtype == "int8")
        num_blocks = receive()
        caches = allocate_caches(spec, num_blocks, dtype, backend.device)
        per_layer = layer_caches(spec, caches, model.config.num_layers)
        self.runner = ModelRunner(model, backend, None, per_layer, block_size=config.block_size)

    def run_step(self, arrays: tuple) -> None:
        self.runner.forward_arrays(*arrays)


def tensor_parallel_worker(config: EngineConfig, rank: int, size: int, address: str,
                           errors) -> None:
    """A tensor-parallel worker process: an equal share of the cores, its shard, its
    steps."""
    import os

    from pdmesh.shared.parallel.tensor_parallel import serve_steps

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    try:
        worker = TensorParallelWorker(config, rank, size, address)
    except Exception as e:
        import traceback

        errors.put((rank, f"{e!r}\n{traceback.format_exc()}"))
        raise
    serve_steps(worker, errors, rank)
