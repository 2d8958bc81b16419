"""`pdmesh config check`: the effective --additional-config, or every error in it.

    pdmesh config check --additional-config '{"scheduler_config": {...}}' \\
        --kv-transfer-config '{"kv_role": "kv_consumer"}' --data-parallel-size 2

    pdmesh config check --vllm-command "vllm serve MODEL --max-model-len 4096 ..."

Exit status 0 and the resolved config as JSON (warnings and inactive keys on stderr; with
``--vllm-command``, also the flags accepted without effect), or 2 and one line per problem.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from pdmesh.shared.config.engine_args import EngineArgs
from pdmesh.shared.config.errors import ConfigError
from pdmesh.shared.config.json_flags import json_flag
from pdmesh.shared.config.parse import parse_additional_config
from pdmesh.shared.config.service import priority_scheduling
from pdmesh.shared.config.vllm_cli import VllmCommandError, parse_vllm_serve


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--additional-config", default="{}")
    p.add_argument("--kv-transfer-config", default=None)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"))
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--enable-expert-parallel", action="store_true")
    p.add_argument("--enable-eplb", action="store_true")
    p.add_argument("--eplb-config", default=None)
    p.add_argument("--scheduling-policy", default="fcfs")
    p.add_argument("--enable-priority-scheduling", action="store_true")
    p.add_argument("--schedule-low-priority-values-first", action="store_true")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--vllm-command", default=None,
                   help="a whole `vllm serve MODEL ...` line; checks it instead of the "
                        "flags above (shell variables and env read from this environment)")


def run(a: argparse.Namespace) -> int:
    if a.vllm_command is not None:
        return _run_vllm_command(a.vllm_command, a.device)
    try:
        kv_transfer = json_flag("--kv-transfer-config", a.kv_transfer_config)
        engine = EngineArgs(
            kv_role=kv_transfer.get("kv_role"), data_parallel_size=a.data_parallel_size,
            tensor_parallel_size=a.tensor_parallel_size,
            pipeline_parallel_size=a.pipeline_parallel_size,
            enable_expert_parallel=a.enable_expert_parallel, enable_eplb=a.enable_eplb,
            eplb_config=json_flag("--eplb-config", a.eplb_config),
            scheduling_policy=priority_scheduling(a)[0], enforce_eager=a.enforce_eager)
        config = parse_additional_config(a.additional_config, device=a.device,
                                         engine_args=engine)
    except ConfigError as e:
        for problem in e.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for w in config.warnings:
        print(f"warning: {w}", file=sys.stderr)
    effective = dataclasses.asdict(config)
    effective.pop("warnings", None)
    effective.pop("inactive_keys", None)
    print(json.dumps(effective, indent=2, sort_keys=True, default=str))
    return 0


def _run_vllm_command(command: str, device: str) -> int:
    try:
        config = parse_vllm_serve(command, device=device, env=os.environ,
                                  variables=os.environ)
    except (ConfigError, VllmCommandError) as e:
        for problem in e.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    if config.accepted_without_effect:
        print(f"accepted without effect: {' '.join(config.accepted_without_effect)}",
              file=sys.stderr)
    for w in config.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if config.additional_config.inactive_keys:
        print(f"inactive on {device}: {', '.join(config.additional_config.inactive_keys)}",
              file=sys.stderr)
    effective = dataclasses.asdict(config)
    for key in ("warnings", "accepted_without_effect"):
        effective.pop(key)
    for key in ("warnings", "inactive_keys"):
        effective["additional_config"].pop(key)
    print(json.dumps(effective, indent=2, sort_keys=True, default=str))
    return 0
