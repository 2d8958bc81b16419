"""flags -> ServeConfig: the one path from a command line to what a service runs.

    words ──parse_command_line──▶ Flags ──read_config──▶ ServeConfig (flags checked
    together: --kv-transfer-config, priority scheduling, --additional-config and its
    cross-key rules) ──resolve──▶ ServeConfig (+ what runs: the device, the EngineConfig;
    what pdmesh cannot run yet refused, e.g. tensor parallelism beside DP)

Every service, `pdmesh up` (for the flags it hands to its engines), `pdmesh serve` and
`pdmesh config check` go through ``serve_config``, so `config check` accepts exactly the
command lines a service accepts and refuses exactly what it refuses. Nothing is loaded:
a bad flag stops start-up before the model is read. Every problem raises as a ValueError
naming the flag (a FlagError or ConfigError listing them all).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from pdmesh.shared.config.command_line import Flags, parse_command_line
from pdmesh.shared.config.engine_args import EngineArgs
from pdmesh.shared.config.environment import environment_warnings
from pdmesh.shared.config.flags import ENGINES
from pdmesh.shared.config.parse import parse_additional_config
from pdmesh.shared.config.schema import AdditionalConfig
from pdmesh.shared.config.sglang_flags import reasons as sglang_reasons
from pdmesh.shared.config.sglang_parallel import read_sglang_parallel
from pdmesh.shared.config.sglang_speculative import read_sglang_speculative
from pdmesh.shared.engine.config import EngineConfig
from pdmesh.shared.engine.spec_decode import RUN_METHODS, SpeculativeConfig

log = logging.getLogger(__name__)

ROLE_KV = {"prefill": "kv_producer", "decode": "kv_consumer", "mixed": None}
KV_ROLE_OF = {"kv_producer": "prefill", "kv_consumer": "decode"}


@dataclass(frozen=True)
class ServeConfig:
    """A command's configuration. Its flags read as attributes (``config.max_model_len``),
    as argparse's namespace would; the rest is what they resolve to."""

    command: str
    flags: Flags
    role: str | None = None  # the engine role it configures: prefill | decode | mixed
    kv_role: str | None = None
    kv_transfer: Mapping[str, Any] = field(default_factory=dict)
    additional_config: AdditionalConfig = field(default_factory=AdditionalConfig)
    engine_args: EngineArgs = field(default_factory=EngineArgs)
    priority_low_values_first: bool = True
    priority_preemption_threshold: int | None = None  # None: no priority preemption
    default_priority: int = 0  # of a request that gives none
    device: str | None = None  # resolved (engine roles)
    engine: Any = None  # the EngineConfig it runs (engine roles, resolved)
    env: Mapping[str, str] = field(default_factory=dict)  # a vllm line's NAME=VALUE words
    warnings: tuple[str, ...] = ()  # --additional-config's
    flag_warnings: tuple[str, ...] = ()  # flags given that act only with others
    accepted_without_effect: tuple[str, ...] = ()

    def __getattr__(self, name: str) -> Any:
        if name == "flags":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.flags, name)

    @property
    def served_model_name(self) -> tuple[str, ...]:
        return tuple(self.flags.served_model_name or ())

    @property
    def model_name(self) -> str:
        """The name clients ask for (the first served name, else the model path)."""
        names = self.served_model_name
        return names[0] if names else (self.flags.model or "")

    def log_warnings(self) -> None:
        """What a service says at start-up about its flags (SGLang's with the reason,
        among ``flag_warnings``)."""
        plain = [f for f in self.accepted_without_effect if f not in sglang_reasons()]
        if plain:
            log.warning("accepted for vLLM / SGLang compatibility, without effect: %s",
                        ", ".join(plain))
        for w in self.flag_warnings:
            log.warning("%s", w)
        for w in self.warnings:
            log.warning("--additional-config: %s", w)
        if self.additional_config.inactive_keys:
            log.warning("--additional-config: inactive on %s: %s", self.device,
                        ", ".join(self.additional_config.inactive_keys))


def serve_config(command: str, words: list[str], *, env: Mapping[str, str] | None = None,
                 device: str | None = None) -> ServeConfig:
    """What ``pdmesh COMMAND words...`` would run, or a ValueError naming every problem.
    ``device``: check as if --device resolved to it (it only changes warnings: which
    keys are inactive there) instead of looking for devices, which imports torch."""
    return resolve(read_config(parse_command_line(command, words), env=env, device=device))


def read_config(flags: Flags, *, device: str | None = None,
                env: Mapping[str, str] | None = None) -> ServeConfig:
    """The flags checked together; for an engine role, --additional-config parsed with
    the cross-key rules (on ``device``: default the one --device resolves to)."""
    role = engine_role(flags)
    compat = tuple(flags.without_effect)
    said: list[str] = environment_warnings(os.environ if env is None else env)
    why = sglang_reasons()
    said += [f"{f}: without effect ({why[f]})" for f in compat if f in why]
    flags, layout = read_sglang_parallel(flags)
    said += layout
    flags, drafting = read_sglang_speculative(flags)
    said += drafting
    if getattr(flags, "tokenizer_mode", None) == "slow":
        said.append("--tokenizer-mode slow: read as auto (pdmesh tokenizes with the "
                    "model's tokenizer.json, the fast tokenizer; a slow tokenizer that "
                    "splits text differently is not what it runs)")
    spec = getattr(flags, "speculative_config", None)
    if spec is not None and not isinstance(spec, dict):
        raise ValueError(f"--speculative-config: must be a JSON object, got {spec!r}")
    method = spec.get("method") if spec is not None else None
    if spec is not None and method not in RUN_METHODS:
        compat += ("--speculative-config",)
        said.append(f"--speculative-config: method {method!r} is not run yet "
                             f"(pdmesh drafts with {', '.join(RUN_METHODS)}); decoding one "
                             "token a step")
    elif spec is not None and (idle := SpeculativeConfig.inactive_keys(spec)):
        said.append(f"--speculative-config: without effect: {', '.join(idle)}")
    if role is None:
        return ServeConfig(flags.command, flags, flag_warnings=tuple(said),
                           accepted_without_effect=compat)
    kv_transfer = dict(flags.kv_transfer_config or {})
    kv_role = kv_transfer.get("kv_role", ROLE_KV[role] if _fixed_role(flags) else None)
    if _fixed_role(flags) and ROLE_KV[role] is not None and kv_role != ROLE_KV[role]:
        raise ValueError(f"--kv-transfer-config: kv_role {kv_role!r} does not fit a {role} "
                         f"instance (expected {ROLE_KV[role]!r})")
    if flags.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size: must be >= 1, got {flags.data_parallel_size}")
    from pdmesh.shared.config import kv_transfer as kv_transfer_fields

    kv_warnings = kv_transfer_fields.check(kv_transfer, role, flags.data_parallel_size,
                                           flags.tensor_parallel_size) if kv_transfer else []
    prio = priority_scheduling(flags)
    policy = prio.policy
    engine_args = EngineArgs(
        kv_role=kv_role, data_parallel_size=flags.data_parallel_size,
        data_parallel_size_local=flags.data_parallel_size_local,
        tensor_parallel_size=flags.tensor_parallel_size,
        pipeline_parallel_size=flags.pipeline_parallel_size or 1,
        enable_expert_parallel=flags.enable_expert_parallel, enable_eplb=flags.enable_eplb,
        eplb_config=flags.eplb_config or {}, scheduling_policy=policy,
        enforce_eager=flags.enforce_eager or getattr(flags, "disable_cuda_graph", False),
        speculative_method=(flags.speculative_config or {}).get("method"))
    device = device or _device(flags.device, checking=flags.command == "config check")
    additional = parse_additional_config(flags.additional_config, env=env, device=device,
                                         engine_args=engine_args)
    return ServeConfig(flags.command, flags, role, kv_role, kv_transfer, additional,
                       engine_args, prio.low_values_first, prio.preemption_threshold,
                       prio.default_priority, device, env=dict(env or {}),
                       warnings=tuple(additional.warnings),
                       flag_warnings=(*prio.warnings, *kv_warnings, *said),
                       accepted_without_effect=compat)


def resolve(config: ServeConfig) -> ServeConfig:
    """What the command will run, with what pdmesh cannot run (yet) refused."""
    f = config.flags
    _at_least(f, "max_queued_requests", 1)
    _at_least(f, "stream_interval", 1)
    _at_least(f, "decode_log_interval", 0)
    _at_least(f, "max_prefill_tokens", 1)
    chunk = getattr(f, "chunked_prefill_size", None)
    if chunk is not None and chunk != -1 and chunk < 1:
        raise ValueError(f"--chunked-prefill-size: must be >= 1, or -1 (no chunking), got "
                         f"{chunk}")
    timeout = getattr(f, "kv_load_timeout", None)
    if timeout is not None and not 0 <= timeout < float("inf"):
        raise ValueError(f"--kv-load-timeout: must be a number of seconds >= 0 (0: no "
                         f"limit), got {timeout}")
    if config.command in ("gateway", "up", "serve", "decode"):
        _at_least(f, "prefill_offload_threshold", 0)
        _positive(f, "decode_tpot_slo_ms")
    if config.command == "eplb":
        _positive(f, "interval_s")
    if config.command == "kvstore":
        from pdmesh.shared.kvpool.master import EvictionPolicy

        EvictionPolicy(f.kv_lease_ttl_ms, f.eviction_high_watermark_ratio, f.eviction_ratio)
    if config.role is None:
        return config
    _tensor_parallel(f)
    _context_length(f)
    from pdmesh.shared.config.engine_config import serving_engine_config

    try:
        engine = serving_engine_config(config)
    except ValueError as e:  # (named as the flag is spelled)
        if str(e).startswith("compilation_config"):
            raise ValueError("--compilation-config" + str(e).removeprefix(
                "compilation_config")) from None
        raise
    # what the decode graphs make of --compilation-config (and SGLang's graph flags)
    graphs = tuple("--compilation-config" + w.removeprefix("compilation_config")
                   for w in engine.graph_config().warnings)
    if config.device == "cpu" and (engine.compilation_config or not engine.cuda_graph_padding):
        graphs = ("decode graphs: without effect on cpu (a CPU launches no kernels to "
                  "capture; every step runs eagerly): --compilation-config, --cuda-graph-*",)
    if engine.cpu_offload_gb:
        graphs += ("--cpu-offload-gb: without effect on cpu (the weights are in host memory "
                   "already)" if config.device == "cpu" else "--cpu-offload-gb: decode "
                   "graphs off (each forward copies the offloaded layers over)",)
    from pdmesh.shared.config.tier_flags import idle_pool_flags, idle_tier_flags

    return dataclasses.replace(config, engine=engine, flag_warnings=(
        *config.flag_warnings, *graphs, *_pooling(config, engine), *idle_tier_flags(f),
        *idle_pool_flags(f, config.role, engine.kv_tiers)))


def _pooling(config: ServeConfig, engine: EngineConfig) -> tuple[str, ...]:
    """The pooling runner's checks: refused on a decode instance (it continues
    generations another instance prefilled), --pooler-config read against the model's
    folder when it is here; what is without effect under it."""
    if not engine.pools:
        return ("--pooler-config: without effect: the instance generates (it needs "
                "--runner pooling)",) if engine.pooler_config else ()
    if config.role == "decode":
        raise ValueError("--runner: pooling serves embeddings from a mixed or prefill "
                         "instance (`pdmesh mixed` / `pdmesh prefill`), not a decode one")
    from pdmesh.shared.engine.pooling import Pooling, with_pooler_config

    _, unused = with_pooler_config(Pooling(), engine.pooler_config)  # (ValueError: a value)
    said = [f"--pooler-config: {k}: without effect (pdmesh pools for embeddings: "
            f"pooling_type, use_activation, dimensions)" for k in unused]
    if "normalize" in (engine.pooler_config or {}):
        said.append("--pooler-config: normalize is vLLM's name before 0.32 (use_activation "
                    "now, which 0.32 requires); read as use_activation")
    if engine.speculative_config is not None:
        said.append("--speculative-config: without effect under --runner pooling (an "
                    "embedding drafts no tokens)")
    return tuple(said)


def _tensor_parallel(f: Flags) -> None:
    """--tensor-parallel-size N: N ranks per DP rank; refused for a model it does not
    divide (read from the model's headers when the folder is here)."""
    tp = f.tensor_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size: must be >= 1, got {tp}")
    if tp == 1:
        return
    model = getattr(f, "model", None)
    if model and (Path(model) / "config.json").is_file():  # (before any rank starts)
        from pdmesh.shared.models.loader import check_tensor_parallel

        try:
            check_tensor_parallel(model, tp, f.quantization,
                                  experts=not f.enable_expert_parallel)
        except ValueError as e:
            raise ValueError("--tensor-parallel-size: "
                             + str(e).removeprefix("tensor_parallel_size: ")) from None


def _context_length(f: Flags) -> None:
    """--max-model-len past the model's positions, refused before anything loads (when
    the model's folder is here)."""
    model, asked = getattr(f, "model", None), getattr(f, "max_model_len", None)
    if not (model and asked and (Path(model) / "config.json").is_file()):
        return
    from pdmesh.shared.models.config import ModelConfig

    limit = ModelConfig.from_folder(model, getattr(f, "hf_overrides", None)
                                    ).max_position_embeddings
    if asked > limit:
        raise ValueError(f"--max-model-len: {asked} exceeds the model's "
                         f"max_position_embeddings ({limit})")


def engine_role(flags: Flags) -> str | None:
    """The engine role a command line configures: the engine commands their own, `serve`
    a mixed instance, `config check` what --role or the kv_role says."""
    if flags.command in ENGINES:
        return flags.command
    if flags.command == "serve":
        return "mixed"
    if flags.command == "config check":
        if flags.role:
            return flags.role
        kv_role = (flags.kv_transfer_config or {}).get("kv_role")
        return KV_ROLE_OF.get(kv_role, "mixed")
    return None


def _fixed_role(flags: Flags) -> bool:
    """The role is the command's (or --role's), not read from the kv_role."""
    return flags.command in ENGINES or bool(getattr(flags, "role", None))


class PrioritySettings(NamedTuple):
    policy: str
    low_values_first: bool
    preemption_threshold: int | None  # None: a waiting request never preempts
    default_priority: int
    warnings: tuple[str, ...]


def priority_scheduling(f: Any) -> PrioritySettings:
    """The scheduling policy and, for "priority", its order, preemption and default.

    Two flag families ask for priority scheduling, each with its own default order:
    vLLM's ``--scheduling-policy priority`` serves lower values first; SGLang's
    ``--enable-priority-scheduling`` serves larger values first, lower ones with
    ``--schedule-low-priority-values-first``. Given together they must agree on lower
    first. SGLang's family also brings its preemption (a waiting request preempts
    running ones it outranks by more than ``--priority-scheduling-preemption-threshold``,
    unless ``--disable-priority-preemption``) and its default for a request that gives
    no priority (the lowest there is, unless ``--default-priority-value``); vLLM's has
    neither (requests without one get 0). ValueError naming the flag otherwise.
    """
    sglang, low_first = f.enable_priority_scheduling, f.schedule_low_priority_values_first
    vllm = f.scheduling_policy == "priority"
    if low_first and not (sglang or vllm):
        raise ValueError("--schedule-low-priority-values-first: only with "
                         "--enable-priority-scheduling")
    if sglang and vllm and not low_first:
        raise ValueError("--enable-priority-scheduling: serves larger priority values first, "
                         "--scheduling-policy priority lower ones; give one of them, or add "
                         "--schedule-low-priority-values-first")
    threshold = f.priority_scheduling_preemption_threshold
    if threshold < 0:
        raise ValueError(f"--priority-scheduling-preemption-threshold: must be >= 0, got "
                         f"{threshold}")
    given = set(getattr(f, "given", ()))
    warnings = ()
    if not sglang:
        idle = [name for name in ("--priority-scheduling-preemption-threshold",
                                  "--disable-priority-preemption") if name in given]
        if idle:
            warnings = (f"{', '.join(idle)}: without effect (priority preemption comes with "
                        f"--enable-priority-scheduling)",)
    default = f.default_priority_value
    if default is None:
        default = (sys.maxsize if low_first else -sys.maxsize - 1) if sglang else 0
    order = getattr(f, "schedule_policy", None)  # SGLang's queue order
    if order is not None and (sglang or vllm):
        warnings += (f"--schedule-policy {order}: without effect (priority scheduling "
                     "orders the queue)",)
    if not (sglang or vllm):
        policy = f.scheduling_policy
        if order == "dfs-weight":  # (its radix-tree walk groups shared prefixes: lpm's aim)
            warnings += ("--schedule-policy dfs-weight: read as lpm (longest cached prefix "
                         "first)",)
            order = "lpm"
        return PrioritySettings(order or policy, True, None, default, warnings)
    preempt = sglang and not f.disable_priority_preemption
    return PrioritySettings("priority", low_first or not sglang,
                            threshold if preempt else None, default, warnings)


API_KEY_ENV = ("PDMESH_API_KEY", "VLLM_API_KEY")


def api_key(f: Any, env: Mapping[str, str] | None = None) -> str | None:
    """The API key clients must send: ``--api-key``, else the first line of
    ``--api-key-file``, else the first of PDMESH_API_KEY and VLLM_API_KEY set (vLLM's
    variable) - None: no key. ValueError naming the flag for an unreadable or empty
    file."""
    if f.api_key:
        return f.api_key
    if f.api_key_file:
        try:
            with open(f.api_key_file) as fh:
                key = fh.readline().strip()
        except OSError as e:
            raise ValueError(f"--api-key-file: cannot read {f.api_key_file}: "
                             f"{e.strerror}") from None
        if not key:
            raise ValueError(f"--api-key-file: {f.api_key_file} is empty")
        return key
    env = os.environ if env is None else env
    return next((env[name] for name in API_KEY_ENV if env.get(name)), None)


def _device(device: str, checking: bool = False) -> str:
    """The device ``--device`` resolves to; `config check` takes a named one as it is (it
    checks a line for that device, which this machine need not have)."""
    if checking and device != "auto":
        return device
    from pdmesh.shared.kernels import resolve_device

    return resolve_device(device)


def _at_least(f: Flags, name: str, low: int) -> None:
    value = getattr(f, name, None)
    if value is not None and value < low:
        raise ValueError(f"--{name.replace('_', '-')}: must be >= {low}, got {value}")


def _positive(f: Flags, name: str) -> None:
    import math

    value = getattr(f, name)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"--{name.replace('_', '-')}: must be a positive number, got {value}")
