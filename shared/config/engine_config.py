"""The EngineConfig an engine service runs, from its flags and the resolved service
config (``resolve_service_config``): every flag checked before anything heavy starts."""

from __future__ import annotations

import argparse
import dataclasses

from pdmesh.shared.config.service import (
    ServiceConfig,
    add_service_args,
    resolve_service_config,
)
from pdmesh.shared.engine.args import add_engine_args, engine_config_from_args
from pdmesh.shared.engine.config import EngineConfig
from pdmesh.shared.infra.net import reachable_host
from pdmesh.shared.infra.registry import add_registry_args
from pdmesh.shared.infra.tracing import add_tracing_args


def add_engine_service_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free one)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--kvstore", default=None,
                   help="the kvstore service's gRPC address (prefill and decode need one; "
                        "a mixed instance runs without a pool)")
    p.add_argument("--pool-segment-mb", type=int, default=512,
                   help="memory this instance lends to the KV pool")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="refuse a request (gRPC RESOURCE_EXHAUSTED) while this many wait "
                        "to run on this instance (default: no limit)")
    g = p.add_argument_group("data parallel ranks (vllm serve flags)")
    g.add_argument("--data-parallel-rank", type=int, default=None,
                   help="run as this one rank of a data-parallel instance (the instance's "
                        "launcher sets it; without it, --data-parallel-size N starts N ranks)")
    g.add_argument("--data-parallel-address", default=None,
                   help="host of rank 0's process-group store (default: --host)")
    g.add_argument("--data-parallel-rpc-port", type=int, default=None,
                   help="port of rank 0's process-group store (default: a free one)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds requests in flight get to finish")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="HTTP port of /metrics (0: any free one; -1: none)")
    g.add_argument("--eplb-address", default=None,
                   help="the EPLB controller's gRPC address, with dynamic EPLB (default: the "
                        "one in the registry)")
    add_registry_args(p)
    add_tracing_args(p)
    add_service_args(p)


def resolve_engine(a: argparse.Namespace, role: str) -> tuple[EngineConfig, ServiceConfig]:
    """ValueError (ConfigError) naming every bad flag; nothing is loaded."""
    from pdmesh.shared.kernels import resolve_device

    device = resolve_device(a.device)
    service = resolve_service_config(a, role, device)
    if role != "mixed" and not a.kvstore:
        raise ValueError(f"--kvstore: a {role} instance needs the kvstore's address")
    config = dataclasses.replace(engine_config_from_args(a), **parallel_settings(a, service),
                                 **scheduling_settings(a, service),
                                 **serving_defaults(a, device))
    sched = service.additional.scheduler_config
    if sched.dyntra_lb_config.enabled:
        config = dataclasses.replace(config, dyntra_lb=sched.dyntra_lb_config)
    if sched.recompute_scheduler_enable and role == "decode":  # (a warning elsewhere)
        config = dataclasses.replace(config, recompute_scheduler=True)
    return config, service


# vLLM's defaults for `vllm serve` on CPU (the offline LLM keeps the larger ones)
CPU_SERVING_MAX_NUM_BATCHED_TOKENS = 2048


def serving_defaults(a: argparse.Namespace, device: str) -> dict:
    """EngineConfig fields whose default differs when serving, as in vLLM: on CPU a step
    computes at most 2,048 tokens unless --max-num-batched-tokens says otherwise, so a
    burst of prompts is prefilled in chunks and the first ones answer early, not all
    together after one long step."""
    if a.max_num_batched_tokens is None and device == "cpu":
        return {"max_num_batched_tokens": CPU_SERVING_MAX_NUM_BATCHED_TOKENS}
    return {}


def parallel_settings(a: argparse.Namespace, service) -> dict:
    """EngineConfig fields for data / expert parallelism and EPLB, from the flags and
    ``eplb_config`` (vLLM-Ascend's fields) or upstream ``--eplb-config``."""
    if a.data_parallel_size == 1:
        return {}
    eplb = service.additional.eplb_config
    upstream = service.engine_args.eplb_config if service.engine_args.enable_eplb else {}
    dynamic = eplb.dynamic_eplb or service.engine_args.enable_eplb
    if upstream:
        window = int(upstream.get("window_size", 1000))
        redundant = int(upstream.get("num_redundant_experts", 0))
        phase = eplb.load_collection_phase
    else:
        window = eplb.expert_heat_collection_interval
        redundant = eplb.num_redundant_experts
        phase = eplb.eplb_heat_collection_stage
    host = a.data_parallel_address or reachable_host(a.host)
    return {"data_parallel_size": a.data_parallel_size,
            "data_parallel_rank": a.data_parallel_rank or 0,
            "data_parallel_address": f"{host}:{a.data_parallel_rpc_port}",
            "enable_expert_parallel": a.enable_expert_parallel,
            "num_redundant_experts": redundant if a.enable_expert_parallel else 0,
            "expert_map_path": eplb.expert_map_path if a.enable_expert_parallel else None,
            "expert_map_record_path": (eplb.expert_map_record_path
                                       if a.enable_expert_parallel else None),
            "expert_load_window": max(window, 1) if dynamic else 0,
            "expert_load_phase": phase}


def scheduling_settings(a: argparse.Namespace, service) -> dict:
    """EngineConfig fields for the waiting queue: the policy (priority from either flag
    family, as ``resolve_service_config`` resolved it; ShortRequestFirst from
    ``scheduler_config.short_request_first_config``, which the config rules allow only
    on prefill and mixed instances with FCFS) and ``--max-queued-requests``."""
    if a.max_queued_requests is not None and a.max_queued_requests < 1:
        raise ValueError(f"--max-queued-requests: must be >= 1, got {a.max_queued_requests}")
    srf = service.additional.scheduler_config.short_request_first_config
    fields = {"scheduling_policy": service.engine_args.scheduling_policy,
              "priority_low_values_first": service.priority_low_values_first,
              "max_queued_requests": a.max_queued_requests}
    if srf.enabled:
        fields.update(scheduling_policy="short_request_first",
                      short_request_threshold=srf.threshold,
                      short_request_long_max_wait_ms=srf.long_max_wait_ms)
    return fields
