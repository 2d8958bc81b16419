"""EPLB: vLLM-Ascend's own ``eplb_config`` versus upstream ``--enable-eplb``.

Seed ``additional-config.zh.txt`` lines 49-52: Model Runner V2 accepts only
``load_collection_phase`` in eplb_config and takes upstream --enable-eplb / --eplb-config;
Model Runner V1 accepts the legacy fields but not ``load_collection_phase`` and not
upstream --enable-eplb; "混合两种模式会在启动时失败，而不是静默忽略配置".
"""

from __future__ import annotations

from pdmesh.shared.config.rules.base import Findings, RuleContext

_EPLB = "eplb_config"
_PHASE = f"{_EPLB}.load_collection_phase"
_UPSTREAM = "--enable-eplb/--eplb-config"


def eplb_runner_schema(ctx: RuleContext, out: Findings) -> None:
    """The two EPLB schemas, one per model runner, and no mixing (seed lines 49-52; code:
    platform.py::_validate_eplb_config, which also needs --enable-eplb for a phase)."""
    legacy = [p for p in ctx.set_under(_EPLB) if p != _PHASE]
    upstream = ctx.engine.uses_upstream_eplb
    mrv2 = bool(ctx.engine.model_runner_v2)
    for path in legacy:
        if upstream:
            out.error(ctx.name(path), f"a vLLM-Ascend (Model Runner V1) EPLB field cannot be "
                                      f"mixed with upstream {_UPSTREAM}; use one or the other")
        elif mrv2:
            out.error(ctx.name(path), "Model Runner V2 accepts only eplb_config."
                                      "load_collection_phase; configure EPLB with upstream "
                                      f"{_UPSTREAM}")
    if not mrv2:
        if ctx.is_set(_PHASE):
            out.error(ctx.name(_PHASE), "only Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1) "
                                        "reads it; on Model Runner V1 use eplb_config."
                                        "eplb_heat_collection_stage")
        if upstream and not legacy:
            out.error("--enable-eplb", "upstream EPLB is not accepted by Model Runner V1 on "
                                       "Ascend; use eplb_config.dynamic_eplb, or Model Runner "
                                       "V2 (VLLM_USE_V2_MODEL_RUNNER=1)")
    elif ctx.config.eplb_config.load_collection_phase != "all" and not ctx.engine.enable_eplb:
        out.error(ctx.name(_PHASE), "needs upstream --enable-eplb")


def eplb_needs_expert_parallel(ctx: RuleContext, out: Findings) -> None:
    """EPLB moves experts between EP ranks. Upstream vLLM ParallelConfig: "enable_expert_
    parallel must be True to use EPLB"; legacy dynamic EPLB without EP only warns."""
    if ctx.engine.enable_expert_parallel:
        return
    if ctx.engine.enable_eplb:
        out.error("--enable-eplb", "EPLB needs --enable-expert-parallel")
    if ctx.config.eplb_config.dynamic_eplb:
        out.warn(ctx.name(f"{_EPLB}.dynamic_eplb"),
                 "has no effect without --enable-expert-parallel")


# the fields pdmesh acts on once experts are spread over several ranks
_MOVES_EXPERTS = ("dynamic_eplb", "num_redundant_experts", "expert_map_path",
                  "expert_map_record_path", "expert_heat_collection_interval",
                  "algorithm_execution_interval", "eplb_heat_collection_stage",
                  "load_collection_phase", "eplb_policy_type")

# upstream vLLM's EPLBConfig (vllm/config/parallel.py, 0.32): each key's type or values
# and its lower bound; pdmesh acts on the first three and on policy "default"
_UPSTREAM_KEYS: dict[str, tuple[object, int | None]] = {
    "window_size": (int, 1), "step_interval": (int, 1), "num_redundant_experts": (int, 0),
    "log_balancedness": (bool, None), "log_balancedness_interval": (int, 1),
    "use_async": (bool, None), "policy": (("default",), None),
    "communicator": (("torch_nccl", "torch_gloo", "torch_xccl", "nixl", "pynccl"), None),
    "enable_migration_batching": (bool, None)}
_UPSTREAM_WITHOUT_EFFECT = {
    "log_balancedness": "the EPLB controller logs each decision's balancedness, and "
                        "`pdmesh status` and its metrics show it",
    "log_balancedness_interval": "the EPLB controller logs each decision's balancedness",
    "communicator": "pdmesh moves expert weights over the DP group's own collectives",
    "enable_migration_batching": "pdmesh moves one MoE layer's experts per step, "
                                 "between steps"}


def upstream_eplb_config(ctx: RuleContext, out: Findings) -> None:
    """--eplb-config as vLLM's EPLBConfig takes it: unknown keys and bad values refused
    (vLLM's config forbids extra keys), its two cross-checks, and what pdmesh does not
    act on said."""
    given = ctx.engine.eplb_config
    for key, value in given.items():
        name = f"--eplb-config.{key}"
        if key not in _UPSTREAM_KEYS:
            out.error(name, f"not a vLLM EPLB field (one of {', '.join(_UPSTREAM_KEYS)})")
            continue
        kind, low = _UPSTREAM_KEYS[key]
        if isinstance(kind, tuple):
            if value not in kind:
                out.error(name, f"must be one of {', '.join(kind)}, got {value!r}")
        elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            out.error(name, f"must be {'a boolean' if kind is bool else 'an integer'}, "
                            f"got {value!r}")
        elif low is not None and value < low:
            out.error(name, f"must be >= {low}, got {value}")
        elif key in _UPSTREAM_WITHOUT_EFFECT:
            out.warn(name, f"without effect: {_UPSTREAM_WITHOUT_EFFECT[key]}")
    use_async = given.get("use_async", True)
    if use_async and given.get("policy", "default") != "default":
        out.error("--eplb-config.policy", "async EPLB is only supported with the default "
                                          "policy")
    if use_async and given.get("communicator") in ("torch_nccl", "pynccl"):
        out.error("--eplb-config.communicator", f"{given['communicator']} is incompatible "
                  "with async EPLB; use torch_gloo or nixl, or leave it unset")
    if use_async is False:
        out.warn("--eplb-config.use_async", "without effect: pdmesh always moves experts "
                 "between steps, one MoE layer a step, while serving (vLLM's async mode)")


def expert_parallel_over_one_rank(ctx: RuleContext, out: Findings) -> None:
    """Expert parallelism spreads the experts over DP x TP ranks (vLLM's EP size): on one
    rank it, and every EPLB field, does nothing; said rather than silently dropped."""
    e = ctx.engine
    if not e.enable_expert_parallel or e.data_parallel_size * e.tensor_parallel_size > 1:
        return
    out.warn("--enable-expert-parallel", "without effect: one rank (data-parallel size x "
             "tensor-parallel size is 1) holds every expert")
    for field in _MOVES_EXPERTS:
        if ctx.is_set(f"{_EPLB}.{field}"):
            out.warn(ctx.name(f"{_EPLB}.{field}"), "without effect: expert parallelism "
                     "over one rank has no expert to move")


def eplb_record_path(ctx: RuleContext, out: Findings) -> None:
    """Recording an expert map runs dynamic EPLB (code: EplbConfig sets dynamic_eplb when
    expert_map_record_path is given)."""
    eplb = ctx.config.eplb_config
    if eplb.expert_map_record_path is None or eplb.dynamic_eplb:
        return
    path = f"{_EPLB}.dynamic_eplb"
    warning = None
    if ctx.is_set(path):
        warning = "set to true because eplb_config.expert_map_record_path is given"
    out.override(path, True, warning, key=ctx.name(path))


def force_eplb_vs_dynamic(ctx: RuleContext, out: Findings) -> None:
    """enable_force_eplb and dynamic EPLB exclude each other (code: "enable_force_eplb
    cannot be mixed with dynamic_eplb")."""
    if ctx.config.enable_force_eplb and ctx.config.eplb_config.dynamic_eplb:
        out.error(ctx.name("enable_force_eplb"),
                  f"cannot be combined with {ctx.name(_EPLB + '.dynamic_eplb')}")


def eplb_policy(ctx: RuleContext, out: Findings) -> None:
    """The EPLB controller places by the instance's eplb_policy_type (shared/parallel/
    swift_balance.py, flash_lb.py): the test policy (0) swaps ranks 3 and 1, which a
    smaller expert-parallel world lacks."""
    path = f"{_EPLB}.eplb_policy_type"
    e = ctx.engine
    if not ctx.is_set(path) or not e.enable_expert_parallel:
        return
    policy = ctx.config.eplb_config.eplb_policy_type
    world = e.data_parallel_size * e.tensor_parallel_size
    if e.enable_eplb:
        out.warn(ctx.name(path), "without effect: upstream --enable-eplb places by "
                 "DeepSeek's policy, as vLLM does")
    elif policy == 0 and 1 < world < 4:
        out.warn(ctx.name(path), f"without effect: 0 swaps the last experts of ranks 3 and "
                 f"1, and the instance has {world} expert-parallel ranks")


RULES = (
    upstream_eplb_config,
    eplb_policy,
    eplb_runner_schema,
    eplb_needs_expert_parallel,
    expert_parallel_over_one_rank,
    eplb_record_path,
    force_eplb_vs_dynamic,
)
