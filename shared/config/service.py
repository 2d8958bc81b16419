"""The serving flags beyond the engine's: parallelism, PD roles, --additional-config.

Spelled as ``vllm serve`` spells them. ``resolve_service_config`` checks them together at
start-up: a bad value or a forbidden combination stops the service with every problem
named, before any model is loaded.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from typing import Any

from shared.config.engine_args import EngineArgs
from shared.config.parse import parse_additional_config
from shared.config.schema import AdditionalConfig

log = logging.getLogger(__name__)

ROLE_KV = {"prefill": "kv_producer", "decode": "kv_consumer", "mixed": None}


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


@dataclass(frozen=True)
class ServiceConfig:
    kv_role: str | None
    kv_transfer: dict[str, Any]
    additional: AdditionalConfig


def json_flag(flag: str, text: str | None) -> dict[str, Any]:
    """A flag holding a JSON object; ValueError naming the flag otherwise."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: invalid JSON at line {e.lineno} column {e.colno}: "
                         f"{e.msg}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: must be a JSON object")
    return value


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
    if a.data_parallel_size != 1:
        raise ValueError(f"--data-parallel-size: {a.data_parallel_size} is not supported yet "
                         "(data-parallel ranks arrive with expert parallelism; use 1)")
    engine = EngineArgs(
        kv_role=kv_role, data_parallel_size=a.data_parallel_size,
        tensor_parallel_size=a.tensor_parallel_size,
        enable_expert_parallel=a.enable_expert_parallel, enable_eplb=a.enable_eplb,
        eplb_config=json_flag("--eplb-config", a.eplb_config),
        scheduling_policy=a.scheduling_policy, enforce_eager=a.enforce_eager)
    additional = parse_additional_config(a.additional_config, device=device,
                                         engine_args=engine)
    for w in additional.warnings:
        log.warning("--additional-config: %s", w)
    if additional.inactive_keys:
        log.warning("--additional-config: inactive on %s: %s", device,
                    ", ".join(additional.inactive_keys))
    return ServiceConfig(kv_role, kv_transfer, additional)
