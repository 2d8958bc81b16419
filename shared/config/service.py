"""The serving flags beyond the engine's: parallelism, PD roles, --additional-config,
priority scheduling.

Spelled as ``vllm serve`` spells them; priority scheduling also as SGLang spells it.
``resolve_service_config`` checks them together at start-up: a bad value or a forbidden
combination stops the service with every problem named, before any model is loaded.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

from pdmesh.shared.config.engine_args import EngineArgs
from pdmesh.shared.config.json_flags import json_flag
from pdmesh.shared.config.parse import parse_additional_config
from pdmesh.shared.config.schema import AdditionalConfig
from pdmesh.shared.config.vllm_cli import FLAGS

log = logging.getLogger(__name__)

ROLE_KV = {"prefill": "kv_producer", "decode": "kv_consumer", "mixed": None}
COMPAT_PREFIX = "vllm_compat_"


def add_service_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving (vllm serve flags)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    g.add_argument("--enable-expert-parallel", action="store_true")
    g.add_argument("--enable-eplb", action="store_true")
    g.add_argument("--eplb-config", default=None, help="upstream vLLM EPLB config (JSON)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="accepted for vLLM compatibility; pdmesh runs eagerly everywhere")
    g.add_argument("--kv-transfer-config", default=None,
                   help='JSON: {"kv_connector": ..., "kv_role": "kv_producer" | '
                        '"kv_consumer" | "kv_both", "kv_port": ..., "engine_id": ..., '
                        '"kv_connector_extra_config": {...}}')
    g.add_argument("--additional-config", default="{}",
                   help="vLLM-Ascend's additional config (JSON), validated strictly")
    prio = p.add_argument_group("priority scheduling (SGLang flags)")
    prio.add_argument("--enable-priority-scheduling", action="store_true",
                      help="schedule by the request's priority, larger values first "
                           "(SGLang's order; --scheduling-policy priority: lower first)")
    prio.add_argument("--schedule-low-priority-values-first", action="store_true",
                      help="with --enable-priority-scheduling: lower priority values first")
    # the rest of `vllm serve`'s flags that pdmesh has no use for: accepted, so a vLLM
    # command line starts unchanged, and listed in a start-up warning
    taken = {s for action in p._actions for s in action.option_strings}
    compat = p.add_argument_group("vllm serve flags accepted without effect")
    for name, flag in FLAGS.items():
        if flag.effect or name in taken:
            continue
        dest = COMPAT_PREFIX + name.lstrip("-").replace("-", "_")
        if flag.kind == "bool":
            compat.add_argument(name, dest=dest, action="store_true", help=argparse.SUPPRESS)
        else:
            compat.add_argument(name, dest=dest, default=None, nargs="+" if flag.kind ==
                                "names" else None, help=argparse.SUPPRESS)


@dataclass(frozen=True)
class ServiceConfig:
    kv_role: str | None
    kv_transfer: dict[str, Any]
    additional: AdditionalConfig
    engine_args: EngineArgs  # scheduling_policy: the effective one (either flag family)
    priority_low_values_first: bool = True


def priority_scheduling(a: argparse.Namespace) -> tuple[str, bool]:
    """The scheduling policy and, for "priority", whether lower values go first.

    Two flag families ask for priority scheduling, each with its own default order:
    vLLM's ``--scheduling-policy priority`` serves lower values first; SGLang's
    ``--enable-priority-scheduling`` serves larger values first, lower ones with
    ``--schedule-low-priority-values-first``. Given together they must agree on lower
    first. ValueError naming the flag otherwise.
    """
    sglang, low_first = a.enable_priority_scheduling, a.schedule_low_priority_values_first
    vllm = a.scheduling_policy == "priority"
    if low_first and not (sglang or vllm):
        raise ValueError("--schedule-low-priority-values-first: only with "
                         "--enable-priority-scheduling")
    if sglang and vllm and not low_first:
        raise ValueError("--enable-priority-scheduling: serves larger priority values first, "
                         "--scheduling-policy priority lower ones; give one of them, or add "
                         "--schedule-low-priority-values-first")
    if sglang:
        return "priority", low_first
    return a.scheduling_policy, True


def resolve_service_config(a: argparse.Namespace, role: str, device: str) -> ServiceConfig:
    """ValueError (ConfigError for --additional-config) naming every bad flag or key."""
    kv_transfer = json_flag("--kv-transfer-config", a.kv_transfer_config)
    kv_role = kv_transfer.get("kv_role", ROLE_KV[role])
    expected = ROLE_KV[role]
    if expected is not None and kv_role != expected:
        raise ValueError(f"--kv-transfer-config: kv_role {kv_role!r} does not fit a {role} "
                         f"instance (expected {expected!r})")
    if a.tensor_parallel_size != 1:
        raise ValueError(f"--tensor-parallel-size: {a.tensor_parallel_size} is not supported "
                         "yet; pdmesh runs one model replica per instance (use 1)")
    if a.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size: must be >= 1, got {a.data_parallel_size}")
    policy, low_first = priority_scheduling(a)
    engine = EngineArgs(
        kv_role=kv_role, data_parallel_size=a.data_parallel_size,
        tensor_parallel_size=a.tensor_parallel_size,
        enable_expert_parallel=a.enable_expert_parallel, enable_eplb=a.enable_eplb,
        eplb_config=json_flag("--eplb-config", a.eplb_config),
        scheduling_policy=policy, enforce_eager=a.enforce_eager)
    additional = parse_additional_config(a.additional_config, device=device,
                                         engine_args=engine)
    ignored = sorted("--" + k[len(COMPAT_PREFIX):].replace("_", "-")
                     for k, v in vars(a).items()
                     if k.startswith(COMPAT_PREFIX) and v not in (None, False))
    if ignored:
        log.warning("accepted for vLLM compatibility, without effect: %s", ", ".join(ignored))
    for w in additional.warnings:
        log.warning("--additional-config: %s", w)
    if additional.inactive_keys:
        log.warning("--additional-config: inactive on %s: %s", device,
                    ", ".join(additional.inactive_keys))
    return ServiceConfig(kv_role, kv_transfer, additional, engine, low_first)
