"""``parse_additional_config``: the one entry point from user input to ``AdditionalConfig``.

    raw JSON / mapping ──decode──▶ dict ──apply_legacy (moved keys, removed keys, env)──▶
    dict in today's spelling ──read_section──▶ typed config ──run_rules──▶ overrides ──▶
    AdditionalConfig (+ warnings, inactive keys)

Every problem from every stage after decoding is collected; one ``ConfigError`` lists
them all. Nothing is logged here: callers log ``config.warnings`` with their own context.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from typing import Any

from pdmesh.shared.config.engine_args import EngineArgs
from pdmesh.shared.config.errors import ConfigError, ConfigProblem
from pdmesh.shared.config.legacy import MODEL_RUNNER_V2_ENV
from pdmesh.shared.config.migrate import apply_legacy, decode
from pdmesh.shared.config.options import schema_fields, spec_of
from pdmesh.shared.config.reader import ReadContext, read_section
from pdmesh.shared.config.rules import RuleContext, run_rules
from pdmesh.shared.config.schema import AdditionalConfig
from pdmesh.shared.engine.spec_decode import MTP_METHODS, RUN_METHODS

DEVICES = ("cpu", "cuda", "npu")


def parse_additional_config(
    raw: str | Mapping[str, Any],
    *,
    env: Mapping[str, str] | None = None,
    device: str = "cpu",
    engine_args: EngineArgs | None = None,
) -> AdditionalConfig:
    """Parse and validate ``--additional-config`` more strictly than vLLM-Ascend does.

    ``raw`` is the flag's JSON text or an already-decoded mapping (the offline
    ``additional_config=`` argument). ``env`` (default: ``os.environ``) supplies the
    deprecated environment variables. ``device`` is the resolved device ("cpu", "cuda" or
    "npu"); keys that only act in vLLM-Ascend's Ascend runtime are listed in
    ``inactive_keys`` on every device (the warning says why).
    ``engine_args`` are the engine flags the cross-key rules need.

    Raises ``ConfigError`` listing every unknown key, bad value and forbidden combination.
    """
    if device not in DEVICES:
        raise ConfigError([ConfigProblem("device", f"must be one of {', '.join(DEVICES)}, "
                                                   f"got {device!r}")])
    env = os.environ if env is None else env
    engine = engine_args or EngineArgs()
    if engine.model_runner_v2 is None:
        use_v2 = env.get(MODEL_RUNNER_V2_ENV, "0").strip().lower() in ("1", "true")
        engine = dataclasses.replace(engine, model_runner_v2=use_v2)

    tree = decode(raw)
    ctx = ReadContext(root=AdditionalConfig)
    removed = apply_legacy(tree, env, AdditionalConfig, ctx)
    config = read_section(AdditionalConfig, tree, "", "", ctx)
    findings = run_rules(RuleContext(config, engine, frozenset(ctx.explicit), dict(ctx.shown)))
    problems = ctx.problems + findings.problems
    if problems:
        raise ConfigError(problems)

    for path, value in findings.overrides.items():
        config = _replace_path(config, path, value)
    npu_only = ascend_only_keys(ctx.explicit)
    warnings = ctx.warnings + findings.warnings
    if npu_only and device == "npu":
        warnings.append(f"{len(npu_only)} key(s) set vLLM-Ascend's own graph passes, fused "
                        "operators, communication or runtime, which pdmesh's npu backend "
                        f"does not implement; without effect: {', '.join(npu_only)}")
    elif npu_only:
        warnings.append(f"{len(npu_only)} key(s) only act on Ascend NPUs and are inactive on "
                        f"{device}: {', '.join(npu_only)}")
    unbuilt = unimplemented_keys(ctx.explicit)
    if engine.speculative_method in RUN_METHODS:  # drafts run: their verifier reads it
        unbuilt = [k for k in unbuilt if k != "rejection_sampler_config"]
    if engine.speculative_method in MTP_METHODS:  # MTP drafts carry a confidence
        unbuilt = [k for k in unbuilt if k != "dynamic_spec_config"]
    if unbuilt:
        warnings.append(f"{len(unbuilt)} key(s) pdmesh does not implement yet; without "
                        f"effect: {', '.join(unbuilt)}")
    inactive = (*sorted(removed), *npu_only, *unbuilt)
    return dataclasses.replace(config, warnings=tuple(warnings), inactive_keys=inactive)


# vLLM-Ascend keys for any device that pdmesh validates but does not act on (yet): the
# speculative-decoding sections act once drafts run (rejection_sampler_config with any
# method, dynamic_spec_config with MTP drafts); the rest have no counterpart in pdmesh's
# scheduler or EPLB controller
UNIMPLEMENTED = ("rejection_sampler_config", "dynamic_spec_config",
                 "enable_force_eplb", "mix_placement",
                 "enable_context_parallel", "enable_reduce_sample", "draft_window_size",
                 "SLO_limits_for_dynamic_batch", "scheduler_config.enable_balance_scheduling",
                 "scheduler_config.profiling_chunk_config",
                 "scheduler_config.batch_job_sched_config")


def unimplemented_keys(explicit: set[str] | frozenset[str]) -> list[str]:
    """The explicitly set keys pdmesh does not act on, a section standing for its keys."""
    return sorted(key for key in UNIMPLEMENTED
                  if any(p == key or p.startswith(key + ".") for p in explicit))


def ascend_only_keys(explicit: set[str] | frozenset[str]) -> list[str]:
    """The explicitly set keys that only act on Ascend, a section standing for its keys.
    None of them acts in pdmesh (on npu either: they tune vLLM-Ascend's own runtime); a
    key pdmesh's npu backend comes to implement loses its ``ascend_only`` mark."""
    found = []
    for path in sorted(explicit, key=lambda p: (p.count("."), p)):
        if any(path.startswith(done + ".") for done in found):
            continue
        if _is_ascend_only(path):
            found.append(path)
    return sorted(found)


def _is_ascend_only(path: str) -> bool:
    cls: Any = AdditionalConfig
    for name in path.split("."):
        field = next(f for f in schema_fields(cls) if f.name == name)
        spec = spec_of(field)
        if spec is not None and spec.ascend_only:
            return True
        cls = typing.get_type_hints(cls)[name]
    return False


def _replace_path(obj: Any, path: str, value: object) -> Any:
    name, _, rest = path.partition(".")
    if rest:
        value = _replace_path(getattr(obj, name), rest, value)
    return dataclasses.replace(obj, **{name: value})
