"""``scheduler_config``: the scheduler policies an engine can run, and their knobs.

Defaults and ranges are vLLM-Ascend's (``vllm_ascend/ascend_config.py``: SchedulerConfig,
DyntraLBConfig, ShortRequestFirstConfig, ProfilingChunkConfig, BatchJobSchedConfig).
The policies are scheduling logic, not kernels, so none of these keys is Ascend-only.
Which node role may run which policy is checked in ``pdmesh.shared.config.rules.scheduler``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdmesh.shared.config.options import option, section


@dataclass(frozen=True)
class DyntraLBConfig:
    """``scheduler_config.dyntra_lb_config``: balance decode requests across the DP ranks of
    one PD-disaggregated decode instance (kv_consumer, data_parallel_size > 1)."""

    enabled: bool = option(False, "Enable DyntraLB and select a DyntraLB-aware scheduler.")
    enable_diagnostics: bool = option(False, "Verbose logs for validation; keep off in production.")
    mode: str = option("dynamic", "When balancing activates.", choices=("dynamic", "static"))
    start_step: int = option(250, "First engine-step snapshot allowed to make a plan.", ge=0)
    end_step: int = option(-1, "Exclusive last snapshot step; -1 means no upper bound.", ge=-1)
    bubble_threshold: float = option(
        5.0, "Max-to-average rank load gap that triggers a change: >= 1 are KV blocks, "
        "< 1 a normalized ratio.", gt=0)
    long_req_block_threshold: int = option(
        700, "Dynamic mode: a new request above this many blocks activates balancing.", gt=0)
    dynamic_max_step: int = option(
        256, "Dynamic mode: stop after this many steps without another long request.", gt=0)


@dataclass(frozen=True)
class ShortRequestFirstConfig:
    """``scheduler_config.short_request_first_config``: a waiting-queue policy that prefills
    short prompts first (FCFS scheduling, prefill or mixed nodes only)."""

    enabled: bool = option(False, "Enable ShortRequestFirst scheduling.", cast=True)
    threshold: int = option(256, "Prompts with at most this many tokens count as short.", ge=0,
                            cast=True)
    long_max_wait_ms: float = option(
        0.0, "Longest a long prefill waits behind short ones before promotion; 0 never "
        "promotes.", ge=0, cast=True)


@dataclass(frozen=True)
class ProfilingChunkConfig:
    """``scheduler_config.profiling_chunk_config``: dynamic chunk sizes for pipeline-parallel
    prefill (needs pipeline_parallel_size > 1)."""

    enabled: bool = option(False, "Enable dynamic chunked pipeline parallel.")
    smooth_factor: float = option(
        1.0, "How much to trust the dynamic prediction, in (0, 1].", gt=0, le=1)
    min_chunk: int = option(4096, "Smallest chunk the dynamic calculation may pick.", gt=0)
    need_timing: bool = option(False, "Online calibration; when unset it follows `enabled`.")
    max_fit_chunk: int = option(30, "Chunk-time samples kept for online calibration.", gt=5)


@dataclass(frozen=True)
class BatchJobSchedConfig:
    """``scheduler_config.batch_job_sched_config``: the batch-job-aware scheduler."""

    enabled: bool = option(False, "Enable the batch-job-aware scheduler.")
    max_jobs: int = option(20, "Most jobs tracked; 0 means unlimited.", ge=0)
    reserve_margin_blocks: int = option(2, "Extra KV blocks kept as a safety margin.", ge=0)
    reserve_max_blocks: int = option(8, "Most KV blocks that can be reserved.", gt=0)
    low_available_tokens_threshold: int = option(
        4096, "Above it long decode jobs go first, at or below it short ones do.", gt=0)
    short_decode_token_threshold: int = option(
        32, "Jobs decoding at most this many tokens are short.", gt=0)


@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler_config``: balance, recompute, DyntraLB, ShortRequestFirst, profiling-chunk
    and batch-job scheduling. The deprecated top-level spellings of the first four keys are
    moved here by ``pdmesh.shared.config.legacy``; a value written here wins over them."""

    enable_balance_scheduling: bool = option(
        False, "Balance scheduling across DP ranks (PD-mixed instances only).")
    recompute_scheduler_enable: bool = option(
        False, "Recompute scheduler: hand a request back for re-prefill when decode runs out "
        "of KV memory (PD-disaggregated decode nodes only).", truthy=True)
    short_request_first_config: ShortRequestFirstConfig = section(
        ShortRequestFirstConfig, "ShortRequestFirst prefill scheduling.")
    profiling_chunk_config: ProfilingChunkConfig = section(
        ProfilingChunkConfig, "Dynamic chunked pipeline parallel.")
    batch_job_sched_config: BatchJobSchedConfig = section(
        BatchJobSchedConfig, "Batch-job-aware scheduling.")
    dyntra_lb_config: DyntraLBConfig = section(
        DyntraLBConfig, "DyntraLB decode load balancing across DP ranks.")
