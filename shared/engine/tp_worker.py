"""A tensor-parallel worker rank (> 0): the process rank 0's engine starts beside itself,
holding its shard of the model and of the paged cache and running what rank 0 hands it
(pdmesh.shared.parallel.tp_ranks): the steps, the KV its pool transfers move, and with
expert parallelism its idle steps and EPLB's expert moves."""

from __future__ import annotations

import torch

from pdmesh.shared.engine.config import EngineConfig
from pdmesh.shared.engine.decode_graphs import decode_graphs_for
from pdmesh.shared.engine.kv_cache_spec import allocate_caches, cache_spec, layer_caches
from pdmesh.shared.engine.model_runner import ModelRunner
from pdmesh.shared.kernels import get_backend, resolve_device
from pdmesh.shared.models.config import ModelConfig, parse_dtype
from pdmesh.shared.models.loader import load_model
from pdmesh.shared.models.transformer import weight_bytes
from pdmesh.shared.parallel.tp_ranks import READY, Topology, agree, join, receive


def set_rank_device(device: str, rank: int) -> None:
    """Rank r computes on device r of the node (the devices its DP rank was given)."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    elif device == "npu":
        torch.npu.set_device(rank)  # type: ignore[attr-defined]


def tensor_shard(config: EngineConfig, rank: int):
    """Tensor-parallel rank ``rank``'s shard: the routed experts whole under expert
    parallelism, the shared ones whole under enable_shared_expert_dp (with EP)."""
    from pdmesh.shared.parallel.tensor_parallel import Shard

    ep = config.enable_expert_parallel
    return Shard(rank, config.tensor_parallel_size, experts=not ep,
                 shared=not (ep and config.enable_shared_expert_dp))


def drafts_with_mtp(config: EngineConfig) -> bool:
    """Whether the engine drafts with the model's MTP layer (its workers then hold their
    shard of it and of its KV)."""
    from pdmesh.shared.engine.spec_decode import SpeculativeConfig

    raw = config.speculative_config
    if raw is None:
        return False
    spec = raw if isinstance(raw, SpeculativeConfig) else SpeculativeConfig.from_dict(raw)
    return spec.is_mtp


def draft_tokens(config: EngineConfig, model) -> int:
    """The most drafts a step verifies (0: no speculative decoding), as rank 0 resolves
    it (an MTP config without a count: the model's MTP layers)."""
    from pdmesh.shared.engine.spec_decode import SpeculativeConfig

    raw = config.speculative_config
    if raw is None:
        return 0
    spec = raw if isinstance(raw, SpeculativeConfig) else SpeculativeConfig.from_dict(raw)
    return spec.num_speculative_tokens or (len(model.w.mtp) if spec.is_mtp else 0)


def expert_parallel(config: EngineConfig, model) -> bool:
    """Whether this engine places its experts over its ranks (EP on a MoE model)."""
    return bool(config.enable_expert_parallel and model.moe_layers)


class TensorParallelWorker:
    """A tensor-parallel rank > 0: its shard of the model and of the paged cache (as many
    blocks as rank 0's), running what rank 0 hands it."""

    def __init__(self, config: EngineConfig, rank: int, top: Topology, messages):
        device = resolve_device(config.device)
        set_rank_device(device, rank)
        self.backend = backend = get_backend(device)
        torch.manual_seed(config.seed)
        model_cfg = ModelConfig.from_folder(config.model, config.hf_overrides)
        self.dtype = dtype = parse_dtype(config.dtype, default=model_cfg.dtype)
        _, model = load_model(config.model, backend, dtype, model_cfg, config.quantization,
                              shard=tensor_shard(config, rank))
        model.shared_expert_dp = config.enable_shared_expert_dp
        # loaded: rank 0 joins the groups once every rank is here
        messages.put((READY, rank, {"weight_bytes": weight_bytes(model.w)}))
        self.groups = join(top, rank)
        model.tp.group = self.groups.tp
        self.ep = None
        if expert_parallel(config, model):
            from pdmesh.shared.parallel.expert_parallel import attach_expert_parallel

            self.ep = attach_expert_parallel(model, model_cfg, top.global_rank(rank),
                                             top.world, config.num_redundant_experts,
                                             config.expert_map_path)
        self.hidden_size = model_cfg.hidden_size
        mtp = drafts_with_mtp(config)
        n_mtp = len(model.w.mtp) if mtp else 0
        spec = cache_spec(model.config, config.block_size, mtp_layers=n_mtp,
                          int8=config.kv_cache_dtype == "int8")
        num_blocks = receive(self.groups)
        self.caches = allocate_caches(spec, num_blocks, dtype, backend.device)
        layers = model.config.num_layers
        per_layer = layer_caches(spec, self.caches, layers + n_mtp)
        self.mtp_caches = per_layer[layers:]
        self.block_size = config.block_size
        self.runner = ModelRunner(model, backend, None, per_layer[:layers],
                                  block_size=config.block_size, groups=len(spec.groups))
        # the decode graphs, as rank 0 builds its own: the same steps, captured together
        self.runner.graphs = decode_graphs_for(
            config, model, self.runner, backend, agree=lambda ok: agree(ok, self.groups))
        if self.runner.graphs is not None and config.speculative_config is not None:
            self.runner.graphs.max_per_seq = 1 + draft_tokens(config, model)

    def run(self, message: tuple) -> None:
        kind, body = message
        if kind == "step":
            self.runner.forward_arrays(*body)
        elif kind == "kv":
            from pdmesh.shared.engine.tp_kv import worker_transfer

            worker_transfer(body, self.caches, self.groups)
        elif kind == "mtp" and self.mtp_caches:
            from pdmesh.shared.engine.mtp import mtp_forward_arrays

            *arrays, hidden, index = body
            mtp_forward_arrays(self.runner.model, self.backend, self.mtp_caches[index],
                               self.block_size, hidden, *arrays, index=index)
        elif kind == "idle" and self.ep is not None:
            self.ep.idle_step(self.hidden_size, self.dtype, self.backend.device, self.backend)
        elif kind == "ep_move" and self.ep is not None:
            self.ep.move_experts(*body)
        else:
            raise ValueError(f"tensor-parallel worker: unknown message {kind!r}")


def tensor_parallel_worker(config: EngineConfig, rank: int, top: Topology, messages) -> None:
    """A tensor-parallel worker process: an equal share of the cores, its shard, what
    rank 0 hands it. Its lifetime is rank 0's: a process group of its own (a signal to
    the service's group is rank 0's to handle: it drains, then stops the workers), and
    the kernel kills it when rank 0 dies."""
    import multiprocessing as mp
    import os

    from pdmesh.shared.infra.launcher import die_with_parent
    from pdmesh.shared.parallel.tp_ranks import report_failure, serve_steps

    os.setpgid(0, 0)
    die_with_parent()
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # rank 0 is gone already
        os._exit(1)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // top.tp_size))
    try:
        worker = TensorParallelWorker(config, rank, top, messages)
    except Exception as e:
        report_failure(messages, rank, e)
        raise
    serve_steps(worker, messages, rank, worker.groups)
