"""SGLang's parallel layout flags, read into pdmesh's (the flags of every command that
takes them: the services, `pdmesh serve`, `pdmesh sglang`, `config check`).

    --enable-dp-attention --tp-size T --dp-size D
        SGLang counts every rank in T; attention runs data-parallel, T / D ranks of TP
        each, and the FFN over all T ranks. pdmesh: D DP ranks of TP T / D, in lockstep,
        the MoE experts spread over all of them (expert parallelism: the same sums as
        SGLang's MoE TP over all ranks, each expert whole on one rank), the dense MLPs
        split over --moe-dense-tp-size ranks (default T) and the LM head over the D
        ranks unless --enable-dp-lm-head (vocabulary-parallel in the attention's TP
        group instead) - vLLM-Ascend's finegrained_tp_config mlp / lmhead keys.
    --expert-parallel-size (--ep-size) E
        1: experts split as TP splits every layer; the number of ranks the MoE spans
        (T): experts spread over them (--enable-expert-parallel).
    --nnodes N --node-rank R --dist-init-addr HOST:PORT
        one node of N, each running D / N of the DP ranks (vLLM's
        --data-parallel-size-local, --data-parallel-start-rank R * D / N), meeting at
        HOST:PORT (--data-parallel-address, --data-parallel-rpc-port); a node but the
        first runs ranks only (--headless). TP ranks stay on one node: a layout that
        splits them over nodes is refused.
"""

from __future__ import annotations

import copy
import json
from typing import Any


def read_sglang_parallel(flags: Any) -> tuple[Any, list[str]]:
    """(``flags`` with SGLang's layout read into vLLM's, what to say at start-up);
    ValueError naming the flag for a layout pdmesh cannot run. ``flags`` is left as it
    was (a copy is changed)."""
    if not hasattr(flags, "enable_dp_attention"):
        return flags, []
    out, said = _layout(flags)
    return _nodes(out), said


def _nodes(flags: Any) -> Any:
    """SGLang's multi-node flags read into vLLM's multi-node DP."""
    nnodes, node = flags.nnodes, flags.node_rank
    if nnodes is None and node is None and flags.dist_init_addr is None:
        return flags
    nnodes, node = nnodes or 1, node or 0
    if nnodes < 1 or not 0 <= node < nnodes:
        raise ValueError(f"--node-rank: must be in [0, --nnodes {nnodes}), got {node}")
    dp = flags.data_parallel_size
    if dp % nnodes:
        raise ValueError(f"--nnodes: each of {nnodes} nodes runs whole DP ranks of "
                         f"{flags.tensor_parallel_size} TP rank(s) (pdmesh's TP ranks stay "
                         f"on one node), and {dp} DP rank(s) do not divide among them")
    out = copy.copy(flags)
    if nnodes > 1:
        host, sep, port = (flags.dist_init_addr or "").rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--dist-init-addr: HOST:PORT where the nodes meet, needed "
                             f"with --nnodes {nnodes}, got {flags.dist_init_addr!r}")
        out.data_parallel_address, out.data_parallel_rpc_port = host.strip("[]"), int(port)
        out.data_parallel_size_local = dp // nnodes
        out.data_parallel_start_rank = node * (dp // nnodes)
        if node and hasattr(out, "headless"):
            out.headless = True
    return out


def _layout(flags: Any) -> tuple[Any, list[str]]:
    ep = getattr(flags, "expert_parallel_size", None)
    dense = getattr(flags, "moe_dense_tp_size", None)
    if not flags.enable_dp_attention:
        return _without_dp_attention(flags, ep, dense)
    return _with_dp_attention(flags, ep, dense)


def _without_dp_attention(flags: Any, ep: int | None, dense: int | None
                          ) -> tuple[Any, list[str]]:
    said: list[str] = []
    if flags.enable_dp_lm_head:
        said.append("--enable-dp-lm-head: without effect (it shapes the LM head under "
                    "--enable-dp-attention; pdmesh's TP ranks split it already)")
    if dense is not None:
        said.append("--moe-dense-tp-size: without effect (it sizes the dense MLPs' TP "
                    "under --enable-dp-attention)")
    if ep is None or ep == 1:
        return flags, said
    out = copy.copy(flags)
    _check_ep(ep, flags.tensor_parallel_size)
    out.enable_expert_parallel = True
    if flags.data_parallel_size > 1:
        said.append(f"--expert-parallel-size: the experts spread over all "
                    f"{flags.data_parallel_size * ep} ranks of the instance, its DP "
                    f"ranks in lockstep (pdmesh's expert parallelism spans every rank)")
    return out, said


def _with_dp_attention(flags: Any, ep: int | None, dense: int | None
                       ) -> tuple[Any, list[str]]:
    said: list[str] = []
    tp, dp = flags.tensor_parallel_size, flags.data_parallel_size
    if tp < dp or tp % dp:
        raise ValueError(f"--enable-dp-attention: --tp-size ({tp}) counts every rank and "
                         f"must be a multiple of --dp-size ({dp})")
    if ep is not None and ep != 1:
        _check_ep(ep, tp)
    if dense is not None and dense not in (1, tp):
        raise ValueError(f"--moe-dense-tp-size: 1 (the dense MLPs whole on each rank) or "
                         f"--tp-size ({tp}, split over every rank), got {dense}")
    out = copy.copy(flags)
    attention_tp = tp // dp
    out.tensor_parallel_size = attention_tp
    out.enable_expert_parallel = True
    fine: dict[str, int] = {}
    speculative = getattr(flags, "speculative_config", None) is not None
    dense_tp = tp if dense is None else dense
    if attention_tp == 1 and dp > 1 and not speculative:
        if dense_tp > 1:
            fine["mlp_tensor_parallel_size"] = dense_tp
        if not flags.enable_dp_lm_head:
            fine["lmhead_tensor_parallel_size"] = dp
    elif dense_tp > 1 or not flags.enable_dp_lm_head:
        why = "speculative decoding" if speculative else f"{attention_tp} TP ranks per DP rank"
        said.append(f"--enable-dp-attention: the dense MLPs and the LM head stay whole on "
                    f"each DP rank (split by its TP ranks): pdmesh splits them over DP "
                    f"ranks only with one TP rank each and no speculative decoding, not "
                    f"with {why}")
    fine = _add_finegrained(out, fine)
    said.append(f"--enable-dp-attention: {dp} DP ranks with {attention_tp} TP rank(s) "
                f"each, in lockstep, the MoE experts spread over all {tp} ranks"
                + "".join(f", {k.removesuffix('_tensor_parallel_size')} over {v} ranks "
                          f"(finegrained_tp_config.{k})" for k, v in fine.items()))
    return out, said


def _add_finegrained(out: Any, fine: dict[str, int]) -> dict[str, int]:
    """``fine``'s keys into --additional-config's finegrained_tp_config, but those the
    line sets itself (they win); returns those added."""
    extra = _json_object(out.additional_config)
    if extra is None:
        return {}  # (the additional config's own error is told when it is parsed)
    given = extra.get("finegrained_tp_config")
    given = given if isinstance(given, dict) else {}
    fine = {k: v for k, v in fine.items() if k not in given}
    if fine:
        extra["finegrained_tp_config"] = {**given, **fine}
        out.additional_config = json.dumps(extra)
    return fine


def _json_object(raw: Any) -> dict[str, Any] | None:
    """--additional-config as a dict (None: not a JSON object)."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, dict):
        return dict(raw)
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _check_ep(ep: int, span: int) -> None:
    if ep != span:
        raise ValueError(f"--expert-parallel-size: pdmesh spreads the experts over every "
                         f"rank the MoE layers span ({span}) or splits them by TP (1), "
                         f"got {ep}")
