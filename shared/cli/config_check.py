"""`pdmesh config check`: what an engine instance would run with these flags, or every
error in them - through the same path the services take (shared.config.serve).

    pdmesh config check --additional-config '{"scheduler_config": {...}}' \\
        --kv-transfer-config '{"kv_role": "kv_consumer"}' --data-parallel-size 2

    pdmesh config check --vllm-command "vllm serve MODEL --max-model-len 4096 ..."

It takes every flag an engine instance takes (the instance: --role, else the kv_role of
--kv-transfer-config), checks them as the instance would at start-up, and prints the
effective --additional-config as JSON; with ``--vllm-command``, the whole configuration
of that line (the flags, the additional config, the EngineConfig). Exit status 0, with
warnings, inactive keys and the flags accepted without effect on stderr; or 2 and one
line per problem. It looks for neither the model nor the kvstore.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from pdmesh.shared.config.serve import ServeConfig, resolve
from pdmesh.shared.config.vllm_cli import parse_vllm_serve


def run(config: ServeConfig) -> int:
    if config.vllm_command is not None:
        config = resolve(parse_vllm_serve(config.vllm_command, device=config.device,
                                          env=os.environ, variables=os.environ))
        report = {**config.flags.values(), "role": config.role,
                  "additional_config": _additional(config),
                  "engine": dataclasses.asdict(config.engine), "env": dict(config.env)}
        for key in ("vllm_command", "log_level", "log_format"):
            report.pop(key, None)
    else:
        report = _additional(config)
    if config.accepted_without_effect:
        print(f"accepted without effect: {' '.join(config.accepted_without_effect)}",
              file=sys.stderr)
    for w in (*config.flag_warnings, *config.warnings):
        print(f"warning: {w}", file=sys.stderr)
    if config.additional_config.inactive_keys:
        print(f"inactive on {config.device}: "
              f"{', '.join(config.additional_config.inactive_keys)}", file=sys.stderr)
    print(json.dumps(report, indent=2, sort_keys=True, default=str))
    return 0


def _additional(config: ServeConfig) -> dict[str, Any]:
    effective = dataclasses.asdict(config.additional_config)
    effective.pop("warnings", None)
    effective.pop("inactive_keys", None)
    return effective
