"""How an engine joins the ranks it computes with: its tensor-parallel workers, the DP
ranks its experts are spread over, the DP ranks fine-grained TP splits modules across."""

from __future__ import annotations

import logging
import os

import torch

from pdmesh.shared.engine.config import EngineConfig
from pdmesh.shared.models.config import ModelConfig

log = logging.getLogger(__name__)


def start_tensor_parallel(config: EngineConfig, model_config: ModelConfig, device: str):
    """Start the other tensor-parallel ranks (they join the groups once every rank has
    loaded its shard): (their TensorParallelRanks, this engine's shard). On CPU each
    rank takes an equal share of the cores. ``model_config``: the whole model's."""
    from pdmesh.shared.engine.tp_worker import tensor_parallel_worker, tensor_shard
    from pdmesh.shared.models.loader import check_tensor_parallel
    from pdmesh.shared.parallel.tp_ranks import TensorParallelRanks

    size = config.tensor_parallel_size
    shard = tensor_shard(config, 0)
    check_tensor_parallel(config.model, size, config.quantization, shard.experts)
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    moe = model_config.moe is not None
    ranks = TensorParallelRanks(config, size, tensor_parallel_worker,
                                shares_experts=config.enable_expert_parallel and moe)
    log.info("engine: tensor-parallel rank 0 of %d (world at %s); ranks 1..%d load their "
             "shards beside it", size, ranks.address, size - 1)
    return ranks, shard


def setup_expert_parallel(config: EngineConfig, model, model_config: ModelConfig,
                          device: str, tp_ranks):
    """With ``enable_expert_parallel`` on a MoE model over several ranks (DP ranks, each
    DP rank's TP ranks): join the ranks' process group (a tensor-parallel engine has
    joined it already) and keep only this rank's experts. None otherwise."""
    tp = config.tensor_parallel_size
    if not (config.enable_expert_parallel and config.data_parallel_size * tp > 1
            and model.moe_layers):
        if config.num_redundant_experts or config.expert_map_path:
            raise ValueError("num_redundant_experts / expert_map_path: only with expert "
                             "parallelism over several ranks on a MoE model")
        return None
    from pdmesh.shared.parallel.expert_parallel import attach_expert_parallel, init_group

    if tp_ranks is None:
        init_group(config.data_parallel_rank, config.data_parallel_size,
                   config.data_parallel_address, device)
    ep = attach_expert_parallel(model, model_config, config.data_parallel_rank * tp,
                                config.data_parallel_size * tp, config.num_redundant_experts,
                                config.expert_map_path)
    if tp_ranks is not None:  # the workers run the same collectives
        ep.announce = tp_ranks.broadcast
    return ep


def setup_finegrained(config: EngineConfig, model, model_config: ModelConfig, fine,
                      joined: bool, device: str) -> None:
    """Fine-grained TP's groups, within the DP ranks' world (joined here unless expert
    parallelism has: ``joined``)."""
    from pdmesh.shared.parallel.finegrained_tp import FineGrainedTP

    if not joined:
        from pdmesh.shared.parallel.expert_parallel import init_group

        init_group(config.data_parallel_rank, config.data_parallel_size,
                   config.data_parallel_address, device)
    model.fg = FineGrainedTP(fine, model_config.vocab_size)
    if fine.shard("mlp") is not None and not any(
            hasattr(getattr(layer, "mlp", None), "gate_up") for layer in model.w.layers):
        log.warning("engine: finegrained_tp_config.mlp_tensor_parallel_size: without effect: "
                    "every layer of this model routes to experts (it splits dense MLPs "
                    "only)")
    log.info("engine: fine-grained TP over DP ranks: %s",
             ", ".join(f"{m} {k}" for m, k in fine.sizes))
