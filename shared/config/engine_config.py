"""The EngineConfig a command runs, from its flags (and, serving, its ServeConfig): the
engine flags as they are, then the fields serving adds - data / expert parallelism and
EPLB, the waiting queue's policy and limit, serving defaults, DyntraLB, the recompute
scheduler."""

from __future__ import annotations

import dataclasses
from typing import Any

from pdmesh.shared.config.tier_flags import tier_config
from pdmesh.shared.engine.config import EngineConfig
from pdmesh.shared.engine.spec_decode import RUN_METHODS, DynamicBudget, SpeculativeConfig

# vLLM's defaults for `vllm serve` on CPU (the offline LLM keeps the larger ones)
CPU_SERVING_MAX_NUM_BATCHED_TOKENS = 2048


def engine_config(f: Any) -> EngineConfig:
    """The engine flags as they are (the offline tools' engine)."""
    return EngineConfig(
        model=f.model, tokenizer=getattr(f, "tokenizer", None), device=f.device,
        dtype=f.dtype, quantization=f.quantization,
        kv_cache_dtype=f.kv_cache_dtype, tensor_parallel_size=getattr(f, "tensor_parallel_size", 1),
        seed=f.seed, block_size=f.block_size,
        max_model_len=f.max_model_len, max_num_seqs=f.max_num_seqs,
        max_num_batched_tokens=step_tokens(f),
        enable_prefix_caching=f.enable_prefix_caching and not getattr(
            f, "disable_radix_cache", False),
        scheduling_policy=f.scheduling_policy, num_kv_blocks=kv_blocks(f),
        kv_cache_memory_bytes=f.kv_cache_memory_bytes,
        gpu_memory_utilization=f.gpu_memory_utilization,
        enforce_eager=getattr(f, "enforce_eager", False) or getattr(f, "disable_cuda_graph",
                                                                    False),
        compilation_config=compilation_config(f),
        cuda_graph_padding=not getattr(f, "disable_cuda_graph_padding", False),
        runner=runner(f), pooler_config=getattr(f, "pooler_config", None),
        hf_overrides=getattr(f, "hf_overrides", None),
        cpu_offload_gb=getattr(f, "cpu_offload_gb", 0.0) or 0.0, kv_tiers=tier_config(f),
        **lora_settings(f))


def lora_settings(f: Any) -> dict[str, Any]:
    """EngineConfig's LoRA fields: --lora-modules / --lora-paths turn --enable-lora on, as
    SGLang's --lora-paths does."""
    from pdmesh.shared.config.lora_flags import lora_modules

    modules = lora_modules(f)
    if not (getattr(f, "enable_lora", False) or modules):
        return {}
    return {"enable_lora": True, "lora_modules": modules,
            "max_loras": getattr(f, "max_loras", 1),
            "max_lora_rank": getattr(f, "max_lora_rank", 16),
            "max_cpu_loras": getattr(f, "max_cpu_loras", None)}


def stats_settings(f: Any) -> dict[str, Any]:
    """The periodic stats line a serving engine writes: SGLang's every
    --decode-log-interval decoding steps when given, else vLLM's every
    VLLM_LOG_STATS_INTERVAL seconds (10) unless --disable-log-stats."""
    import os

    every = getattr(f, "decode_log_interval", 0)
    if every:
        return {"decode_log_interval": every, "log_stats_interval_s": 0.0}
    if getattr(f, "disable_log_stats", False):
        return {}
    raw = os.environ.get("VLLM_LOG_STATS_INTERVAL", "10")
    try:
        interval = float(raw)
    except ValueError:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL: a number of seconds, got {raw!r}") from None
    return {"log_stats_interval_s": max(interval, 0.0)}


def runner(f: Any) -> str:
    """--runner, or what --convert embed, --task embed and SGLang's --is-embedding say
    (pooling); ValueError when they disagree."""
    said = getattr(f, "runner", "auto")
    pools = [name for name, on in (
        ("--convert embed", getattr(f, "convert", "auto") == "embed"),
        ("--task embed", getattr(f, "task", "auto") in ("embed", "embedding")),
        ("--is-embedding", getattr(f, "is_embedding", False))) if on]
    if pools and said == "generate":
        raise ValueError(f"--runner: generate disagrees with {pools[0]} (an embedding "
                         f"model runs the pooling runner)")
    if getattr(f, "task", "auto") == "generate" and (pools or said == "pooling"):
        raise ValueError("--task: generate disagrees with "
                         f"{pools[0] if pools else '--runner pooling'}")
    return "pooling" if pools or said == "pooling" else said


def kv_blocks(f: Any) -> int | None:
    """--num-kv-blocks, else SGLang's --max-total-tokens (the KV pool's size in tokens)
    as blocks, the null block besides."""
    tokens = getattr(f, "max_total_tokens", None)
    if f.num_kv_blocks is not None or tokens is None:
        return f.num_kv_blocks
    if tokens < 1:
        raise ValueError(f"--max-total-tokens: must be >= 1, got {tokens}")
    return -(-tokens // f.block_size) + 1


def compilation_config(f: Any) -> dict[str, Any] | None:
    """--compilation-config, with SGLang's --cuda-graph-bs / --cuda-graph-max-bs as its
    capture sizes (the vLLM keys win)."""
    given = getattr(f, "compilation_config", None)
    if given is not None and not isinstance(given, dict):
        raise ValueError(f"--compilation-config: must be a JSON object, got {given!r}")
    out = dict(given or {})
    bs = getattr(f, "cuda_graph_bs", ())
    if bs:
        try:
            sizes = [int(word) for text in bs for word in text.split(",") if word]
        except ValueError:
            raise ValueError(f"--cuda-graph-bs: batch sizes are integers, got "
                             f"{' '.join(bs)!r}") from None
        out.setdefault("cudagraph_capture_sizes", sizes)
    max_bs = getattr(f, "cuda_graph_max_bs", None)
    if max_bs is not None:
        out.setdefault("max_cudagraph_capture_size", max_bs)
    return out or None


def kv_pool_settings(kv: Any, role: str) -> dict[str, Any]:
    """--kv-transfer-config's kv_load_failure_policy and its extra config's load_async
    and (a decode instance's) consumer_is_to_put, checked by config/kv_transfer.py, as
    EngineConfig fields."""
    out: dict[str, Any] = {}
    if "kv_load_failure_policy" in kv:
        out["kv_load_failure_policy"] = kv["kv_load_failure_policy"]
    extra = kv.get("kv_connector_extra_config") or {}
    if extra.get("load_async") is not None:
        out["kv_load_async"] = extra["load_async"]
    if role == "decode" and extra.get("consumer_is_to_put"):
        out["kv_put_finished"] = True
    return out


def serving_engine_config(cfg: Any) -> EngineConfig:
    """What an engine instance runs (``cfg``: its ServeConfig, read and checked)."""
    config = dataclasses.replace(engine_config(cfg.flags), **parallel_settings(cfg),
                                 **scheduling_settings(cfg),
                                 **serving_defaults(cfg.flags, cfg.device))
    extra = cfg.additional_config
    fine = {k: v for k, v in dataclasses.asdict(extra.finegrained_tp_config).items() if v > 1}
    if fine:  # (the rules checked them against the DP and TP sizes)
        config = dataclasses.replace(config, finegrained_tp_config=fine)
    if extra.enable_shared_expert_dp:  # (switched off by the rules unless EP and TP > 1)
        config = dataclasses.replace(config, enable_shared_expert_dp=True)
    sched = cfg.additional_config.scheduler_config
    if sched.dyntra_lb_config.enabled:
        config = dataclasses.replace(config, dyntra_lb=sched.dyntra_lb_config)
    config = dataclasses.replace(config, **stats_settings(cfg.flags))
    if cfg.flags.kv_load_timeout is not None:
        config = dataclasses.replace(config, kv_load_timeout_s=cfg.flags.kv_load_timeout)
    config = dataclasses.replace(config, **kv_pool_settings(cfg.kv_transfer, cfg.role))
    if sched.recompute_scheduler_enable and cfg.role == "decode":  # (a warning elsewhere)
        config = dataclasses.replace(config, recompute_scheduler=True)
    spec = cfg.flags.speculative_config
    if isinstance(spec, dict) and spec.get("method") in RUN_METHODS:
        try:
            speculative = SpeculativeConfig.from_dict(spec)
        except ValueError as e:
            raise ValueError(f"--speculative-config: {e}") from None
        rs = cfg.additional_config.rejection_sampler_config
        ds = cfg.additional_config.dynamic_spec_config
        dynamic = None
        if ds.method is not None and speculative.is_mtp:  # (ngram: a warning elsewhere)
            p = ds.method_params
            dynamic = DynamicBudget(ds.method, p.initial_verify_budget_per_req,
                                    p.budget_update_interval, p.budget_threshold,
                                    p.min_verify_tokens)
        config = dataclasses.replace(config, speculative_config=dataclasses.replace(
            speculative, enable_block_verify=rs.enable_block_verify,
            enable_entropy_verify=rs.enable_entropy_verify,
            posterior_threshold=rs.posterior_threshold, posterior_alpha=rs.posterior_alpha,
            dynamic=dynamic))
    config.validate()
    return config


def step_tokens(f: Any) -> int | None:
    """The prompt tokens a step computes at most, as the command line says:
    --max-num-batched-tokens, else the least of SGLang's --chunked-prefill-size and
    --max-prefill-tokens (None: the engine's default)."""
    if f.max_num_batched_tokens is not None:
        return f.max_num_batched_tokens
    said = [n for n in (getattr(f, "chunked_prefill_size", None),
                        getattr(f, "max_prefill_tokens", None)) if n is not None and n > 0]
    return min(said) if said else None


def serving_defaults(f: Any, device: str | None) -> dict[str, Any]:
    """EngineConfig fields whose default differs when serving, as in vLLM: on CPU a step
    computes at most 2,048 tokens unless --max-num-batched-tokens says otherwise, so a
    burst of prompts is prefilled in chunks and the first ones answer early, not all
    together after one long step."""
    if step_tokens(f) is None and device == "cpu" and getattr(
            f, "chunked_prefill_size", None) != -1:  # (-1: SGLang's "no chunking")
        return {"max_num_batched_tokens": CPU_SERVING_MAX_NUM_BATCHED_TOKENS}
    return {}


def parallel_settings(cfg: Any) -> dict[str, Any]:
    """EngineConfig fields for data / expert parallelism and EPLB, from the flags and
    ``eplb_config`` (vLLM-Ascend's fields) or upstream ``--eplb-config``. Expert
    parallelism spreads the experts over DP x TP ranks: with one DP rank, over its
    tensor-parallel ranks (vLLM's EP size is DP x TP)."""
    f = cfg.flags
    if f.data_parallel_size == 1 and not (f.enable_expert_parallel
                                          and f.tensor_parallel_size > 1):
        return {}
    from pdmesh.shared.infra.net import reachable_host

    eplb = cfg.additional_config.eplb_config
    upstream = cfg.engine_args.eplb_config if cfg.engine_args.enable_eplb else {}
    dynamic = eplb.dynamic_eplb or cfg.engine_args.enable_eplb
    if cfg.engine_args.enable_eplb:  # (--eplb-config or not: its defaults, MRv2's phase)
        window = int(upstream.get("window_size", 1000))
        redundant = int(upstream.get("num_redundant_experts", 0))
        phase = eplb.load_collection_phase
    else:
        window = eplb.expert_heat_collection_interval
        redundant = eplb.num_redundant_experts
        phase = eplb.eplb_heat_collection_stage
    host = f.data_parallel_address or reachable_host(f.host)
    ep = f.enable_expert_parallel
    return {"data_parallel_size": f.data_parallel_size,
            "data_parallel_rank": f.data_parallel_rank or 0,
            "data_parallel_address": f"{host}:{f.data_parallel_rpc_port}"
            if f.data_parallel_size > 1 else None,
            "enable_expert_parallel": ep,
            "num_redundant_experts": redundant if ep else 0,
            "expert_map_path": eplb.expert_map_path if ep else None,
            "expert_map_record_path": eplb.expert_map_record_path if ep else None,
            "expert_load_window": max(window, 1) if dynamic else 0,
            # (upstream --enable-eplb: vLLM's own, DeepSeek's policy)
            "eplb_policy_type": None if cfg.engine_args.enable_eplb or not ep
            else eplb.eplb_policy_type,
            "eplb_rounds": None if not (dynamic and ep)
            else "vllm" if cfg.engine_args.enable_eplb else "vllm-ascend",
            "eplb_step_interval": int(upstream.get("step_interval", 3000)),
            "eplb_algorithm_steps": eplb.algorithm_execution_interval,
            "expert_load_phase": phase}


def scheduling_settings(cfg: Any) -> dict[str, Any]:
    """EngineConfig fields for the waiting queue: the policy (priority from either flag
    family, as ``read_config`` resolved it; ShortRequestFirst from
    ``scheduler_config.short_request_first_config``, which the config rules allow only
    on prefill and mixed instances with FCFS) and ``--max-queued-requests``."""
    f = cfg.flags
    if f.max_queued_requests is not None and f.max_queued_requests < 1:
        raise ValueError(f"--max-queued-requests: must be >= 1, got {f.max_queued_requests}")
    srf = cfg.additional_config.scheduler_config.short_request_first_config
    fields = {"scheduling_policy": cfg.engine_args.scheduling_policy,
              "priority_low_values_first": cfg.priority_low_values_first,
              "priority_preemption_threshold": cfg.priority_preemption_threshold,
              "default_priority": cfg.default_priority,
              "abort_on_priority_when_disabled": f.abort_on_priority_when_disabled,
              "max_queued_requests": f.max_queued_requests}
    if srf.enabled:
        fields.update(scheduling_policy="short_request_first",
                      short_request_threshold=srf.threshold,
                      short_request_long_max_wait_ms=srf.long_max_wait_ms)
    return fields
