"""Building an engine: everything ``EngineCore`` is handed, wired in the order the parts
need each other.

    ranks      the other tensor-parallel ranks start; each loads its shard
    model      loaded (quantized, sharded, fine-grained TP layout); expert parallelism
               and fine-grained TP join their groups; the expert-load recorder
    caches     the cache layout, its block count from the memory budget (``kv_sizing``),
               the tensors, the block manager and the model runner over them
    features   the sampler, the grammars, the pool connector (and a prefill's saves), the
               proposer, the scheduler, DyntraLB; the step hooks, in their order
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdmesh.shared.engine.block_manager import GroupBlocks, KVCacheManager
from pdmesh.shared.engine.config import EngineConfig
from pdmesh.shared.engine.decode_graphs import decode_graphs_for
from pdmesh.shared.engine.dyntralb import DyntraLB
from pdmesh.shared.engine.engine import EngineCore
from pdmesh.shared.engine.expert_load_step import ExpertLoadStep
from pdmesh.shared.engine.hidden_states import HiddenStates
from pdmesh.shared.engine.kv_cache_spec import (
    KVCacheSpec,
    allocate_caches,
    cache_spec,
    layer_caches,
)
from pdmesh.shared.engine.kv_connector import PoolConnector
from pdmesh.shared.engine.kv_sizing import kv_blocks
from pdmesh.shared.engine.kv_tiers import HostTier, TierConfig
from pdmesh.shared.engine.model_runner import ModelRunner
from pdmesh.shared.engine.mtp import MtpProposer
from pdmesh.shared.engine.parallel_setup import (
    setup_expert_parallel,
    setup_finegrained,
    start_tensor_parallel,
)
from pdmesh.shared.engine.policy import policy_from_config
from pdmesh.shared.engine.pooler import Pooler
from pdmesh.shared.engine.pooling import is_matryoshka, model_pooling
from pdmesh.shared.engine.prompt_saves import PromptSaves
from pdmesh.shared.engine.sampler import Sampler
from pdmesh.shared.engine.scheduler import Scheduler
from pdmesh.shared.engine.spec_decode import (
    Proposer,
    SpecStats,
    SpeculativeConfig,
    make_ngram_proposer,
)
from pdmesh.shared.engine.speculation import Speculation, speculative_config
from pdmesh.shared.engine.stats_log import StatsLog
from pdmesh.shared.engine.step_costs import StepCosts
from pdmesh.shared.engine.step_hooks import StepHook
from pdmesh.shared.engine.structured import GrammarCompiler
from pdmesh.shared.engine.tier_connector import TierConnector, TierWrites
from pdmesh.shared.engine.tp_kv import ShardedPoolConnector
from pdmesh.shared.engine.weight_offload import GIB, offload_layers
from pdmesh.shared.infra.launcher import ready_timeout_s
from pdmesh.shared.kernels import KernelBackend, get_backend, resolve_device
from pdmesh.shared.kvpool.base import CacheRegions, KVPool
from pdmesh.shared.models.checkpoint import model_fingerprint
from pdmesh.shared.models.config import ModelConfig, parse_dtype
from pdmesh.shared.models.deepseek_v4 import DeepseekV4
from pdmesh.shared.models.loader import load_model
from pdmesh.shared.models.transformer import CausalLM, KVCache, weight_bytes
from pdmesh.shared.parallel.expert_load import ExpertLoadRecorder
from pdmesh.shared.parallel.expert_parallel import ExpertParallel
from pdmesh.shared.parallel.finegrained_tp import FineGrainedLayout
from pdmesh.shared.parallel.tp_ranks import TensorParallelRanks

log = logging.getLogger(__name__)


def build_engine(config: EngineConfig, kv_pool: KVPool | None = None,
                 save_prompts: bool = False) -> EngineCore:
    """An engine for ``config``. ``kv_pool``: load prompt blocks from this pool at
    admission; with ``save_prompts`` (a prefill instance) also put every computed
    prompt there."""
    config.validate()
    t0 = time.perf_counter()
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    backend = get_backend(device)
    model_cfg = ModelConfig.from_folder(config.model, config.hf_overrides)
    dtype = parse_dtype(config.dtype, default=model_cfg.dtype)
    max_model_len = _max_model_len(config, model_cfg)  # (before ranks start)
    batched = config.max_num_batched_tokens or max(8192, config.max_num_seqs)
    loaded = _Loaded.load(config, model_cfg, backend, dtype, device)
    pooling = model_pooling(config.model, config.pooler_config)[0] if config.pools else None
    save_prompts = save_prompts and pooling is None  # (an embedding feeds no decode)
    speculative = None if pooling is not None else speculative_config(
        config, loaded.model, loaded.model_config)
    mtp = speculative is not None and speculative.is_mtp
    caches = _Caches.build(config, model_cfg, loaded, mtp, dtype, device, backend,
                           max_model_len, batched)
    connector = _connector(kv_pool, caches, dtype, loaded.tp_ranks, save_prompts, config.kv_tiers)
    if caches.runner.graphs is not None and speculative is not None:
        # verify steps (each sequence 1 + its drafts) replay too
        caches.runner.graphs.max_per_seq = 1 + (speculative.num_speculative_tokens or 0)
    scheduler = _scheduler(config, caches, batched, max_model_len, connector,
                           pooled=connector is not None)
    spec_stats = SpecStats()
    speculation = None if speculative is None else Speculation(
        speculative, _proposer(speculative, loaded, caches, backend), scheduler,
        caches.runner, spec_stats)
    saves = _saves(config, connector, caches.kv)
    step_costs, load_step = StepCosts(), ExpertLoadStep.of(loaded.model.load_recorder)
    pooler = None if pooling is None else Pooler(caches.runner, loaded.model.final_hidden)
    stats = _stats_log(config, scheduler, caches.kv)
    hooks: list[StepHook] = [h for h in (
        load_step, saves, _tier_writes(config, connector, caches.kv), step_costs,
        speculation, pooler, stats,
        HiddenStates(caches.runner, loaded.model.final_hidden)) if h is not None]
    engine = EngineCore(
        config=config, device=device, backend=backend, dtype=dtype,
        model_config=loaded.model_config, model=loaded.model, max_model_len=max_model_len,
        max_num_batched_tokens=batched, cache_spec=caches.spec, pool_spec=caches.pool_spec,
        kv_bytes_per_token=round(caches.pool_spec.bytes_per_token(dtype)),
        kv_fingerprint=caches.fingerprint, kv=caches.kv, runner=caches.runner,
        sampler=Sampler(backend, loaded.model_config.vocab_size),
        grammars=GrammarCompiler(Path(config.tokenizer or config.model) / "tokenizer.json",
                                 loaded.model_config.vocab_size,
                                 loaded.model_config.eos_token_ids),
        scheduler=scheduler, speculative=speculative, speculation=speculation,
        connector=connector, saves=saves, dyntralb=_dyntralb(config, loaded),
        step_costs=step_costs, spec_stats=spec_stats, hooks=hooks,
        tp_ranks=loaded.tp_ranks, tp_weight_bytes=loaded.tp_weight_bytes,
        dp_group=loaded.dp_group, ep=loaded.ep, lockstep=loaded.lockstep, pooling=pooling,
        matryoshka=pooling is not None and is_matryoshka(config.model), stats_log=stats,
        lora=_lora(config, loaded, backend, scheduler, caches.runner))
    _log_ready(engine, caches, time.perf_counter() - t0)
    return engine


def _lora(config: EngineConfig, loaded: _Loaded, backend: KernelBackend,
          scheduler: Scheduler, runner: ModelRunner):
    """The LoRA adapters' manager (--enable-lora), wired to the scheduler (its slots
    bound a step's adapters) and the runner (each row runs its request's)."""
    if not config.enable_lora:
        return None
    from pdmesh.shared.engine.lora import LoraManager
    from pdmesh.shared.engine.lora_request import LoRARequest

    manager = LoraManager(loaded.model, backend, config.max_loras, config.max_lora_rank,
                          config.max_cpu_loras or config.max_loras)
    for i, (name, path) in enumerate(config.lora_modules, start=1):
        try:  # (read now: one that cannot run stops the start, naming it)
            manager.load(LoRARequest(name, i, path))
        except ValueError as e:
            raise ValueError(f"lora_modules: {name}={path}: {e}") from None
    scheduler.max_loras = config.max_loras
    runner.lora = manager
    return manager


def _stats_log(config: EngineConfig, scheduler: Scheduler, kv: KVCacheManager
               ) -> StatsLog | None:
    if not (config.log_stats_interval_s or config.decode_log_interval):
        return None
    return StatsLog(scheduler, kv, config.log_stats_interval_s, config.decode_log_interval)


def _scheduler(config: EngineConfig, caches: _Caches, batched: int, max_model_len: int,
               connector: PoolConnector | None, pooled: bool) -> Scheduler:
    scheduler = Scheduler(caches.kv, policy_from_config(config), config.max_num_seqs,
                          batched, max_model_len, connector,
                          # pool reads run beside the steps, never inside one (TP: the
                          # ranks get their heads of what was read between two steps)
                          async_kv_load=pooled and config.kv_load_async,
                          kv_load_timeout_s=_load_timeout(config))
    scheduler.recompute_elsewhere = config.recompute_scheduler
    scheduler.fail_on_load_error = config.kv_load_failure_policy == "fail"
    return scheduler


@dataclass
class _Loaded:
    """The model, loaded on this rank, and the ranks it was loaded with."""

    model_config: ModelConfig
    model: CausalLM | DeepseekV4
    tp_ranks: TensorParallelRanks | None = None
    tp_weight_bytes: list[int] = field(default_factory=list)
    dp_group: Any = None  # the engines' own group; None: the default one
    ep: ExpertParallel | None = None
    lockstep: bool = False

    @classmethod
    def load(cls, config: EngineConfig, model_cfg: ModelConfig, backend: KernelBackend,
             dtype: torch.dtype, device: str) -> _Loaded:
        tp_ranks = shard = None
        if config.tensor_parallel_size > 1:
            tp_ranks, shard = start_tensor_parallel(config, model_cfg, device)
        fine = FineGrainedLayout.from_config(config.finegrained_tp_config,
                                             config.data_parallel_rank,
                                             config.data_parallel_size)
        try:
            model_config, model = load_model(config.model, backend, dtype, model_cfg,
                                             config.quantization, shard=shard, fine=fine)
            loaded = cls(model_config, model, tp_ranks)
            if tp_ranks is not None:  # every rank has its shard: join their groups
                loaded.tp_weight_bytes = [weight_bytes(model.w), *(
                    r["weight_bytes"] for r in tp_ranks.join(ready_timeout_s()))]
                model.tp.group = tp_ranks.groups.tp
                # tensor-parallel workers share the world with the engines
                loaded.dp_group = tp_ranks.groups.dp
        except BaseException:
            if tp_ranks is not None:
                tp_ranks.kill()
            raise
        loaded.ep = setup_expert_parallel(config, model, model_config, device, tp_ranks)
        model.shared_expert_dp = config.enable_shared_expert_dp
        if fine is not None:
            setup_finegrained(config, model, model_cfg, fine, joined=loaded.ep is not None,
                              device=device)
        loaded.lockstep = loaded.ep is not None or fine is not None
        if (config.dyntra_lb is not None and not loaded.lockstep and model.moe_layers
                and config.data_parallel_size > 1 and tp_ranks is None):
            # vLLM-Ascend runs its DP engine core (ranks in lockstep) for a MoE model
            # without expert parallelism too, and DyntraLB plans there
            from pdmesh.shared.parallel.expert_parallel import init_group

            init_group(config.data_parallel_rank, config.data_parallel_size,
                       config.data_parallel_address, device)
            loaded.lockstep = True
            log.info("engine: DP ranks in lockstep for DyntraLB (a MoE model without "
                     "expert parallelism, as vLLM-Ascend's DP engine core runs it)")
        if config.expert_load_window and model.moe_layers:
            model.load_recorder = ExpertLoadRecorder(
                len(model.moe_layers), model_config.moe.num_experts,
                config.expert_load_window, config.expert_load_phase, backend.device)
        if config.cpu_offload_gb and device != "cpu":  # (before the KV cache takes the room)
            offload_layers(model, int(config.cpu_offload_gb * GIB), device)
        return loaded


@dataclass
class _Caches:
    """The paged KV cache: its layout (and the pool's), blocks, tensors and runner."""

    spec: KVCacheSpec
    pool_spec: KVCacheSpec
    groups: list[GroupBlocks]
    tensors: list[list[torch.Tensor]]  # per cache group
    fingerprint: str
    kv: KVCacheManager
    runner: ModelRunner
    mtp_layers: list[KVCache]  # the MTP layers' caches (drafting with MTP: one each)

    @classmethod
    def build(cls, config: EngineConfig, model_cfg: ModelConfig, loaded: _Loaded, mtp: bool,
              dtype: torch.dtype, device: str, backend: KernelBackend, max_model_len: int,
              batched: int) -> _Caches:
        int8 = config.kv_cache_dtype == "int8"
        # (the model's own config: a tensor-parallel rank's heads)
        n_mtp = len(loaded.model.w.mtp) if mtp else 0
        spec = cache_spec(loaded.model.config, config.block_size, mtp_layers=n_mtp,
                          int8=int8)
        # the layout the pool holds: the whole model's, whatever this engine's TP size
        pool_spec = spec if loaded.tp_ranks is None else cache_spec(
            model_cfg, config.block_size, mtp_layers=n_mtp, int8=int8)
        groups = kv_blocks(config, spec, dtype, device, max_model_len, batched)
        if loaded.tp_ranks is not None:  # the other ranks' caches: as many blocks
            loaded.tp_ranks.broadcast([g.num_blocks for g in groups])
        fingerprint = _fingerprint(config, pool_spec, dtype)  # reads the checkpoint
        kv = KVCacheManager(groups, config.block_size, config.enable_prefix_caching,
                            fingerprint=fingerprint)
        tensors = allocate_caches(spec, [g.num_blocks for g in groups], dtype, backend.device)
        layers = loaded.model_config.num_layers
        per_layer = layer_caches(spec, tensors, layers + n_mtp)
        if loaded.tp_ranks is not None:
            kv_bytes = sum(x.numel() * x.element_size() for group in tensors for x in group)
            log.info("engine: tensor-parallel memory per rank: weights %s MB, KV cache "
                     "%.2f MB each", " / ".join(f"{b / 1e6:.2f}"
                                               for b in loaded.tp_weight_bytes),
                     kv_bytes / 1e6)
        runner = ModelRunner(loaded.model, backend, kv, per_layer[:layers])
        runner.tp_ranks = loaded.tp_ranks
        runner.graphs = decode_graphs_for(
            config, loaded.model, runner, backend,
            agree=None if loaded.tp_ranks is None else loaded.tp_ranks.agree)
        return cls(spec, pool_spec, groups, tensors, fingerprint, kv, runner,
                   per_layer[layers:])


def _connector(kv_pool: KVPool | None, caches: _Caches, dtype: torch.dtype,
               tp_ranks: TensorParallelRanks | None, save_prompts: bool,
               tiers: TierConfig | None) -> PoolConnector | None:
    windows = [g.window for g in caches.groups]
    names = [g.name for g in caches.groups]
    if tiers is not None:
        return TierConnector(_host_tier(tiers, caches, kv_pool), kv_pool,
                             [CacheRegions(t) for t in caches.tensors], caches.kv.hasher,
                             caches.fingerprint, save_prompts, windows=windows, names=names)
    if kv_pool is None:
        return None
    if tp_ranks is not None:
        return ShardedPoolConnector(kv_pool, caches.tensors, caches.pool_spec, dtype, tp_ranks,
                                    caches.kv.hasher, caches.fingerprint, save_prompts,
                                    windows=windows, names=names)
    return PoolConnector(kv_pool, [CacheRegions(t) for t in caches.tensors], caches.kv.hasher,
                         caches.fingerprint, save_prompts, windows=windows, names=names)


def _tier_writes(config: EngineConfig, connector: PoolConnector | None,
                 kv: KVCacheManager) -> TierWrites | None:
    """What fills the host tier (--hicache-write-policy), when there are tiers."""
    if config.kv_tiers is None:
        return None
    assert isinstance(connector, TierConnector)
    return TierWrites(connector, kv, config.kv_tiers.write_policy)


def _saves(config: EngineConfig, connector: PoolConnector | None, kv) -> PromptSaves | None:
    """The pool puts: a prefill instance's prompts, a decode instance's ended requests
    (consumer_is_to_put); None when there is no pool to put into."""
    if connector is None or connector.pool is None:
        return None
    if not (connector.save_prompts or config.kv_put_finished):
        return None
    return PromptSaves(connector, kv, prompts=connector.save_prompts,
                       finished=config.kv_put_finished)


def _load_timeout(config: EngineConfig) -> float | None:
    """How long a pool or tier read may run: --kv-load-timeout, unless the tiers'
    prefetch policy is wait_complete."""
    tiers = config.kv_tiers
    if tiers is not None and tiers.prefetch_policy == "wait_complete":
        return None
    return config.kv_load_timeout_s


def _host_tier(tiers: TierConfig, caches: _Caches, kv_pool: KVPool | None) -> HostTier:
    """L2 (and L3 under it) over the engine's cache groups."""
    groups = [CacheRegions(t).tensors for t in caches.tensors]
    l1 = sum(t.numel() * t.element_size() for ts in groups for t in ts)
    storage = None
    if tiers.storage == "file":
        from pdmesh.shared.kvpool.file import FilePool

        storage = FilePool(tiers.storage_dir)
    elif tiers.storage == "mooncake":
        if kv_pool is None:
            raise ValueError("--hicache-storage-backend mooncake: this engine has no "
                             "Mooncake pool (an instance joins its mesh's kvstore: "
                             "--kvstore or the registry's; the LLM class has none); use "
                             "file here")
        storage = kv_pool
    tier = HostTier(groups, tiers.capacity(l1), storage)
    log.info("kv tiers: %s of host memory (%s blocks), %s, storage %s",
             _gib(sum(s.block_bytes * n for s, n in zip(tier.stores, tier.capacity_blocks,
                                                        strict=True))),
             "/".join(map(str, tier.capacity_blocks)), tiers.write_policy,
             tiers.storage or "none")
    return tier


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _proposer(spec: SpeculativeConfig, loaded: _Loaded, caches: _Caches,
              backend: KernelBackend) -> Proposer:
    if not spec.is_mtp:
        return make_ngram_proposer(spec)
    assert caches.mtp_layers  # (the layout has the MTP layers' caches)
    proposer = MtpProposer(loaded.model, backend, caches.kv, caches.mtp_layers,
                           confidence=spec.dynamic is not None)
    proposer.tp_ranks = loaded.tp_ranks
    return proposer


def _dyntralb(config: EngineConfig, loaded: _Loaded) -> DyntraLB | None:
    if config.dyntra_lb is None:
        return None
    if not loaded.lockstep:
        # vLLM-Ascend plans only on DP ranks that step together (its DP engine core, which
        # MoE models run); a dense model keeps its scheduler class there and never plans
        log.warning("dyntra_lb_config: without effect: these DP ranks do not step together "
                    "(%s), so they have no bubble to balance",
                    "tensor-parallel ranks without expert parallelism" if loaded.tp_ranks
                    else "a dense model, as vLLM-Ascend runs it")
        return None
    return DyntraLB(config.dyntra_lb, config.data_parallel_rank, config.data_parallel_size,
                    config.block_size, config.max_num_seqs)


def _max_model_len(config: EngineConfig, model_cfg: ModelConfig) -> int:
    limit = model_cfg.max_position_embeddings
    asked = config.max_model_len
    if asked is None:
        return limit
    if asked > limit:
        raise ValueError(f"max_model_len: {asked} exceeds the model's "
                         f"max_position_embeddings ({limit})")
    return asked


def _fingerprint(config: EngineConfig, pool_spec: KVCacheSpec, dtype: torch.dtype) -> str:
    """What makes KV interchangeable: the model's content, its cache layout (groups,
    layers, tensors, heads, sizes), the dtype and the block size. The root of every
    block hash, and the prefix of every pool key."""
    layout = hashlib.blake2b(pool_spec.layout().encode(), digest_size=8).hexdigest()
    model = model_fingerprint(config.model)
    if config.hf_overrides:  # (another rope: other KV)
        model += "+" + hashlib.blake2b(json.dumps(config.hf_overrides, sort_keys=True)
                                       .encode(), digest_size=8).hexdigest()
    return f"{model}:{layout}:{str(dtype).removeprefix('torch.')}:{config.block_size}"


def _log_ready(engine: EngineCore, caches: _Caches, seconds: float) -> None:
    """Say the engine is ready (and close its tensor-parallel ranks with it)."""
    if engine.tp_ranks is not None:
        weakref.finalize(engine, engine.tp_ranks.close)
    window = caches.spec.window_bytes(engine.dtype)
    log.info("engine ready in %.2fs: %s on %s, %s, %d KV blocks of %d tokens, "
             "%d KV bytes per token%s", seconds, engine.model_config.architecture,
             engine.device, str(engine.dtype).removeprefix("torch."),
             caches.groups[0].num_blocks, engine.config.block_size, engine.kv_bytes_per_token,
             f" + {window} window bytes per sequence ("
             + ", ".join(f"{g.name}: {g.num_blocks} blocks" for g in caches.groups) + ")"
             if window else "")
