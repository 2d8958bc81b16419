"""`pdmesh config check`: the effective --additional-config, or every error in it.

    pdmesh config check --additional-config '{"scheduler_config": {...}}' \\
        --kv-transfer-config '{"kv_role": "kv_consumer"}' --data-parallel-size 2

Exit status 0 and the resolved config as JSON (warnings and inactive keys on stderr), or
2 and one line per problem.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from shared.config.engine_args import EngineArgs
from shared.config.errors import ConfigError
from shared.config.parse import parse_additional_config
from shared.config.service import json_flag


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
    p.add_argument("--enforce-eager", action="store_true")


def run(a: argparse.Namespace) -> int:
    try:
        kv_transfer = json_flag("--kv-transfer-config", a.kv_transfer_config)
        engine = EngineArgs(
            kv_role=kv_transfer.get("kv_role"), data_parallel_size=a.data_parallel_size,
            tensor_parallel_size=a.tensor_parallel_size,
            pipeline_parallel_size=a.pipeline_parallel_size,
            enable_expert_parallel=a.enable_expert_parallel, enable_eplb=a.enable_eplb,
            eplb_config=json_flag("--eplb-config", a.eplb_config),
            scheduling_policy=a.scheduling_policy, enforce_eager=a.enforce_eager)
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
