"""Which scheduler policies a node may run, and with which others.

Seed references are to ``shared/seeds/additional-config.zh.txt`` (vLLM-Ascend's
additional-config page); "code" is ``vllm_ascend/platform.py::_check_ascend_config`` and
``vllm_ascend/ascend_config.py``.
"""

from __future__ import annotations

from pdmesh.shared.config.rules.base import Findings, RuleContext

_SCHED = "scheduler_config"
_DYNTRA = f"{_SCHED}.dyntra_lb_config"
_SRF = f"{_SCHED}.short_request_first_config"
_CHUNK = f"{_SCHED}.profiling_chunk_config"
_RECOMPUTE = f"{_SCHED}.recompute_scheduler_enable"
_BALANCE = f"{_SCHED}.enable_balance_scheduling"


def dyntra_lb_placement(ctx: RuleContext, out: Findings) -> None:
    """DyntraLB runs only on a decode node with data_parallel_size > 1, all on one node.

    Seed line 62: "仅在具有 data_parallel_size > 1 的 PD 分离解码节点（kv_role="kv_consumer"）
    上受支持". One node: vLLM-Ascend DyntraLB guide ("all DP ranks of the Decode instance
    must be on one node"; code: nnodes_within_dp > 1 is rejected).
    """
    if not ctx.config.scheduler_config.dyntra_lb_config.enabled:
        return
    key, engine = ctx.name(f"{_DYNTRA}.enabled"), ctx.engine
    if not engine.is_decode_node:
        out.error(key, f"DyntraLB only runs on PD-disaggregated decode nodes (kv_role "
                       f"\"kv_consumer\"), but kv_role is {_role(engine.kv_role)}")
    if engine.data_parallel_size <= 1:
        out.error(key, f"DyntraLB balances across DP ranks and needs data_parallel_size > 1, "
                       f"got {engine.data_parallel_size}")
    local = engine.data_parallel_size_local
    if local is not None and local < engine.data_parallel_size:
        out.error(key, f"DyntraLB needs every DP rank of the decode instance on one node, but "
                       f"data_parallel_size_local={local} < data_parallel_size="
                       f"{engine.data_parallel_size}")


def dyntra_lb_exclusions(ctx: RuleContext, out: Findings) -> None:
    """DyntraLB cannot run with balance scheduling or profiling-chunk, and its step window
    must be non-empty (vLLM-Ascend DyntraLB guide "cannot be combined with"; code)."""
    cfg = ctx.config.scheduler_config
    if not cfg.dyntra_lb_config.enabled:
        return
    key = ctx.name(f"{_DYNTRA}.enabled")
    if cfg.enable_balance_scheduling:
        out.error(key, f"DyntraLB cannot be combined with {ctx.name(_BALANCE)}")
    if cfg.profiling_chunk_config.enabled:
        out.error(key, f"DyntraLB cannot be combined with {ctx.name(_CHUNK + '.enabled')}")


def dyntra_lb_step_window(ctx: RuleContext, out: Findings) -> None:
    """end_step, when set, must come after start_step (code: DyntraLBConfig validator)."""
    lb = ctx.config.scheduler_config.dyntra_lb_config
    if lb.end_step != -1 and lb.end_step <= lb.start_step:
        out.error(ctx.name(f"{_DYNTRA}.end_step"),
                  f"must be -1 or greater than start_step={lb.start_step}, got {lb.end_step}")


def recompute_placement(ctx: RuleContext, out: Findings) -> None:
    """The recompute scheduler belongs to decode nodes. On a prefill node it is switched
    off with a warning; on a PD-mixed instance (no kv_role, or kv_both) it is an error.

    vLLM-Ascend additional_config.md (recompute_scheduler_enable: "Only valid on
    PD-disaggregated D nodes") and code (kv_producer: warning, value written back False).
    """
    if not ctx.config.scheduler_config.recompute_scheduler_enable:
        return
    key = ctx.name(_RECOMPUTE)
    if ctx.engine.is_prefill_node:
        out.override(_RECOMPUTE, False, "ignored on a prefill node (kv_role \"kv_producer\"): "
                     "switched off; keep it only on decode nodes", key=key)
    elif not ctx.engine.is_decode_node:
        out.error(key, f"the recompute scheduler only runs on PD-disaggregated decode nodes "
                       f"(kv_role \"kv_consumer\") and is not supported on a PD-mixed "
                       f"instance; kv_role is {_role(ctx.engine.kv_role)}")


def balance_scheduling_placement(ctx: RuleContext, out: Findings) -> None:
    """Balance scheduling runs only on PD-mixed instances (code: "enable_balance_scheduling
    only supports PD-mixed mode")."""
    if ctx.config.scheduler_config.enable_balance_scheduling and not ctx.engine.is_pd_mixed:
        out.error(ctx.name(_BALANCE), f"balance scheduling only runs on PD-mixed instances, but "
                                      f"kv_role is {_role(ctx.engine.kv_role)}")


def short_request_first_placement(ctx: RuleContext, out: Findings) -> None:
    """ShortRequestFirst is an FCFS waiting-queue policy for prefill and mixed nodes.

    Seed line 78: "用于 prefill 和 PD 混合路径上 FCFS 同步或异步调度的等待队列策略。它不支持
    批作业感知、profiling-chunk 或 PD 分离 D 节点调度". Code: policy must be "fcfs".
    """
    cfg = ctx.config.scheduler_config
    if not cfg.short_request_first_config.enabled:
        return
    key = ctx.name(f"{_SRF}.enabled")
    if ctx.engine.is_decode_node:
        out.error(key, "ShortRequestFirst orders prefills; it is not supported on a decode "
                       "node (kv_role \"kv_consumer\")")
    if ctx.engine.scheduling_policy != "fcfs":
        out.error(key, f"ShortRequestFirst replaces the FCFS waiting queue and cannot be used "
                       f"with --scheduling-policy {ctx.engine.scheduling_policy} (nor "
                       f"--enable-priority-scheduling)")
    if cfg.batch_job_sched_config.enabled:
        out.error(key, f"ShortRequestFirst cannot be combined with "
                       f"{ctx.name(_SCHED + '.batch_job_sched_config.enabled')}")
    if cfg.profiling_chunk_config.enabled:
        out.error(key, f"ShortRequestFirst cannot be combined with "
                       f"{ctx.name(_CHUNK + '.enabled')}")


def profiling_chunk(ctx: RuleContext, out: Findings) -> None:
    """Profiling-chunk needs pipeline parallelism and excludes balance scheduling; an unset
    need_timing follows ``enabled``, a need_timing without ``enabled`` is dropped.

    additional_config.md ("Requires pipeline-parallel-size > 1"); code (the balance
    mutex and the need_timing resolution in ProfilingChunkConfig).
    """
    chunk = ctx.config.scheduler_config.profiling_chunk_config
    timing = f"{_CHUNK}.need_timing"
    if not ctx.is_set(timing):
        out.override(timing, chunk.enabled)
    elif chunk.need_timing and not chunk.enabled:
        out.override(timing, False, "ignored because profiling_chunk_config.enabled is false",
                     key=ctx.name(timing))
    if not chunk.enabled:
        return
    key = ctx.name(f"{_CHUNK}.enabled")
    if ctx.engine.pipeline_parallel_size <= 1:
        out.error(key, f"dynamic chunked pipeline parallel needs pipeline_parallel_size > 1, "
                       f"got {ctx.engine.pipeline_parallel_size}")
    if ctx.config.scheduler_config.enable_balance_scheduling:
        out.error(key, f"cannot be combined with {ctx.name(_BALANCE)}")


def _role(kv_role: str | None) -> str:
    return f'"{kv_role}"' if kv_role else "unset (no --kv-transfer-config)"


RULES = (
    dyntra_lb_placement,
    dyntra_lb_exclusions,
    dyntra_lb_step_window,
    recompute_placement,
    balance_scheduling_placement,
    short_request_first_placement,
    profiling_chunk,
)
