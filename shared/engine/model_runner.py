"""Owns the model and its paged KV cache; turns a scheduled step into logits.

Inputs are built on the host with numpy (one flat varlen batch), copied to the device
once, and the attention metadata is prepared once per step for all layers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from pdmesh.shared.engine.block_manager import KVCacheManager
from pdmesh.shared.engine.decode_graphs import DecodeGraphs
from pdmesh.shared.engine.request import Request
from pdmesh.shared.engine.scheduler import SchedulerOutput
from pdmesh.shared.kernels import AttentionMetadata, KernelBackend
from pdmesh.shared.models.transformer import CausalLM, KVCache

log = logging.getLogger(__name__)


@dataclass
class StepRows:
    """What a step computed, row by row: request i computed positions
    ``starts[i] .. starts[i] + counts[i] - 1``, rows ``row_starts[i] ..`` of ``hidden``
    (the target's final hidden states, [T, hidden]; DeepSeek-V4: its streams,
    [T, hc * hidden]), through its block table ``tables[i]`` and the other cache groups'
    ``group_tables[g][i]`` (as they were during the step)."""

    requests: list[Request]
    starts: list[int]
    counts: list[int]
    row_starts: np.ndarray  # [num_seqs + 1]
    tables: np.ndarray  # [num_seqs, width] int32
    group_tables: list[np.ndarray]  # groups 1..: [num_seqs, width_g] int32
    hidden: torch.Tensor


@dataclass
class PromptLogits:
    """A step's logits at the prompt positions of the requests that asked for their
    prompt's logprobs: per span (request, first, count), ``count`` rows (in order, after
    the spans before it) score its prompt tokens ``first ..`` (a position's logits score
    the next token)."""

    spans: list[tuple[Request, int, int]]
    logits: torch.Tensor  # [sum of the counts, V] float32



def _rows_to_sample(step: SchedulerOutput, seq_lens: list[int], qsl: np.ndarray,
                    every_row: bool) -> tuple[list[int], np.ndarray]:
    """(the positions in ``step.requests`` that computed their last token and sample,
    the rows whose logits are computed: each of those's last row, a drafted one's
    1 + d rows; ``every_row``: all of them)."""
    reqs = step.requests
    drafted = {i: len(step.drafts[r].tokens) for i, r in enumerate(reqs) if r in step.drafts}
    sample_idx = [i for i, (r, n) in enumerate(zip(reqs, seq_lens, strict=True))
                  if n == r.num_tokens + drafted.get(i, 0)]
    if every_row:
        return sample_idx, np.arange(int(qsl[-1]))
    if drafted:
        return sample_idx, np.concatenate([np.arange(qsl[i + 1] - 1 - drafted.get(i, 0),
                                                     qsl[i + 1]) for i in sample_idx]
                                          ) if sample_idx else np.zeros(0, dtype=np.int64)
    return sample_idx, qsl[1:][sample_idx] - 1

def prompt_positions(reqs: list[Request], starts: list[int], counts: list[int],
                     qsl: np.ndarray) -> tuple[np.ndarray, list[tuple[Request, int, int]]]:
    """The rows of the step whose logits score prompt tokens not yet scored for requests
    that want their prompt's logprobs, and (request, first token scored, count) each:
    position j scores token j + 1, for j up to the prompt's second-to-last position."""
    rows: list[np.ndarray] = []
    plan: list[tuple[Request, int, int]] = []
    for i, r in enumerate(reqs):
        if not r.wants_prompt_logprobs:
            continue
        lo = max(starts[i], len(r.prompt_logprobs) - 1)  # (scored before a preemption)
        hi = min(starts[i] + counts[i], r.num_prompt_tokens - 1)
        if hi > lo:
            rows.append(np.arange(qsl[i] + lo - starts[i], qsl[i] + hi - starts[i]))
            plan.append((r, lo + 1, hi - lo))
    return (np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)), plan


def attention_metadata(device: torch.device, block_table: np.ndarray, starts: list[int],
                       counts: list[int], seq_lens: list[int], positions: np.ndarray,
                       slots: np.ndarray, qsl: np.ndarray, block_size: int,
                       group_tables: list[np.ndarray] | None = None) -> AttentionMetadata:
    """One varlen batch's attention metadata: sequence i has ``starts[i]`` tokens of
    context and ``counts[i]`` new ones, written to ``slots``."""
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.from_numpy(np.asarray(seq_lens, dtype=np.int32)).to(device),
        context_lens=torch.from_numpy(np.asarray(starts, dtype=np.int32)).to(device),
        block_tables=torch.from_numpy(block_table).to(device),
        query_lens_host=list(counts),
        seq_lens_host=list(seq_lens),
        context_lens_host=list(starts),
        max_query_len=max(counts, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_size=block_size,
        block_tables_host=block_table,
        group_tables_host=group_tables or [],
        positions_host=positions,
    )


class ModelRunner:
    def __init__(self, model: CausalLM, backend: KernelBackend, kv: KVCacheManager | None,
                 kv_caches: list[KVCache], block_size: int | None = None, groups: int = 1):
        """``kv`` None: a tensor-parallel worker's runner, which only runs the steps rank
        0 hands it (``forward_arrays``); ``groups``: then its cache groups."""
        self.model = model
        self.backend = backend
        self.kv = kv
        self.kv_caches = kv_caches
        self.block_size = kv.block_size if kv is not None else block_size
        self.groups = len(kv.groups) if kv is not None else groups
        # tensor parallelism: rank 0 hands each step's arrays to the other ranks
        self.tp_ranks = None
        self.device = backend.device
        self.last_rows: StepRows | None = None
        self.prompt_logits: PromptLogits | None = None  # the last step's (execute)
        # decode steps from captured device graphs (None: every step eagerly)
        self.graphs: DecodeGraphs | None = None
        self.lora = None  # engine.lora.LoraManager: requests' adapters (None: no LoRA)

    def execute(self, step: SchedulerOutput, every_row: bool = False, hidden: bool = False
                ) -> tuple[torch.Tensor, list[int]]:
        """Run the model on one step. Returns (logits [S, V] float32, the positions in
        ``step.requests`` of the S requests that computed their last token and sample).
        A request verifying drafts (``step.drafts``) computes its last token and them,
        and has 1 + d rows, in order, where the others have one.
        ``every_row``: logits of every token computed this step instead, [T, V].
        ``hidden``: keep the step's rows and final hidden states in ``last_rows`` (what
        an MTP proposer continues from). The logits of the prompt positions whose
        logprobs are asked go to ``prompt_logits`` (None: none this step)."""
        reqs, counts = step.requests, step.num_tokens
        starts = [r.num_computed_tokens for r in reqs]
        seq_lens = [s + n for s, n in zip(starts, counts, strict=True)]
        tables = [self.kv.block_ids(r) for r in reqs]
        block_table = block_table_of(tables)
        # the other cache groups' tables (DeepSeek-V4's sliding window), host side
        group_tables = [block_table_of([self.kv.block_ids(r, g) for r in reqs])
                        for g in range(1, len(self.kv.groups))]
        input_ids, positions, slots, qsl = self._token_arrays(step, starts, tables, block_table)
        sample_idx, logits_rows = _rows_to_sample(step, seq_lens, qsl, every_row)
        scored, plan = (np.zeros(0, dtype=np.int64), []) if every_row else \
            prompt_positions(reqs, starts, list(counts), qsl)
        logits_rows = np.concatenate([logits_rows, scored]) if plan else logits_rows

        arrays = (input_ids, positions, block_table, starts, list(counts), seq_lens, slots,
                  qsl, group_tables, logits_rows.astype(np.int64))
        if self.tp_ranks is not None:  # every tensor-parallel rank runs the same step
            self.tp_ranks.broadcast(("step", arrays))
        hidden_out: list[torch.Tensor] | None = [] if hidden else None
        if self.lora is not None:  # each row runs its request's adapter
            rows = [name for r, n in zip(reqs, counts, strict=True)
                    for name in [r.lora.lora_name if r.lora is not None else None] * n]
            self.model.lora = self.lora.step(rows, self.device)
        try:
            logits = self.forward_arrays(*arrays, hidden_out=hidden_out)
        finally:
            self.model.lora = None
        self.prompt_logits = None
        if plan:
            k = len(scored)
            self.prompt_logits = PromptLogits(plan, logits[len(logits) - k:])
            logits = logits[:len(logits) - k]
        if hidden_out is not None:
            self.last_rows = StepRows(list(reqs), starts, list(counts), qsl, block_table,
                                      group_tables, hidden_out[0])
        return logits, sample_idx

    def _token_arrays(self, step: SchedulerOutput, starts: list[int], tables: list[list[int]],
                      block_table: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The step's tokens, flat: (input ids [T], positions [T], cache slots [T], query
        start offsets per request [R + 1])."""
        bs = self.block_size
        reqs, counts = step.requests, step.num_tokens
        num_seqs = len(reqs)
        if step.total_tokens == num_seqs:  # pure decode: one token each (the common step)
            input_ids = np.fromiter((r.token_ids[s] for r, s in zip(reqs, starts, strict=True)),
                                    dtype=np.int64, count=num_seqs)
            positions = np.asarray(starts, dtype=np.int64)
            slots = np.fromiter((t[s // bs] * bs + s % bs for t, s in zip(tables, starts,
                                                                             strict=True)),
                                dtype=np.int64, count=num_seqs)
            return input_ids, positions, slots, np.arange(num_seqs + 1, dtype=np.int32)
        ids: list[int] = []
        for r, s, n in zip(reqs, starts, counts, strict=True):
            drafts = step.drafts.get(r)
            tokens = r.token_ids if drafts is None else r.token_ids + drafts.tokens
            ids.extend(tokens[s:s + n])
        input_ids = np.asarray(ids, dtype=np.int64)
        seq_idx = np.repeat(np.arange(num_seqs), counts)
        offsets = np.arange(len(ids)) - np.repeat(np.cumsum(counts) - counts, counts)
        positions = np.repeat(np.asarray(starts, dtype=np.int64), counts) + offsets
        slots = block_table[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs
        qsl = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(counts, out=qsl[1:])
        return input_ids, positions, slots, qsl

    @contextmanager
    def logits_kept(self) -> Iterator[list[torch.Tensor]]:
        """Every step's logits (a copy), in order, while inside: what benchmarks and
        tests compare between two engines."""
        kept: list[torch.Tensor] = []
        execute = self.execute

        def keep(*args, **kwargs):
            logits, idx = execute(*args, **kwargs)
            kept.append(logits.clone())
            return logits, idx

        self.execute = keep  # type: ignore[method-assign]
        try:
            yield kept
        finally:
            del self.execute  # (the class's own again)

    def forward_nothing(self) -> None:
        """A forward of no tokens: a lockstep rank's idle step, which still makes every
        collective the forward makes (fine-grained TP's, expert parallelism's)."""
        self.forward_arrays(*_nothing())

    def forward_arrays(self, input_ids: np.ndarray, positions: np.ndarray,
                       block_table: np.ndarray, starts: list[int], counts: list[int],
                       seq_lens: list[int], slots: np.ndarray, qsl: np.ndarray,
                       group_tables: list[np.ndarray], logits_rows: np.ndarray,
                       hidden_out: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The model on one step given as its host arrays (what ``execute`` builds and a
        tensor-parallel worker receives)."""
        meta = attention_metadata(self.device, block_table, starts, counts, seq_lens, positions,
                                  slots, qsl, self.block_size, group_tables)
        self.backend.prepare_attention(meta)
        dev = self.device
        ids = torch.from_numpy(input_ids).to(dev)
        pos = torch.from_numpy(positions).to(dev)
        if self.graphs is not None:
            # a uniform step (as many tokens each: decode, or verifying as many drafts;
            # every row's logits) from its graph; lockstep ranks choose together, so
            # every forward asks, an idle one (no sequences) too
            uniform = len(input_ids) == len(logits_rows) == sum(counts) \
                and all(c == counts[0] for c in counts) \
                and np.array_equal(logits_rows, np.arange(len(input_ids)))
            per_seq = counts[0] if counts else 0
            size = self.graphs.size_for(len(counts) if uniform else None, per_seq)
            if size is not None:
                logits = self.graphs.run(ids, pos, meta, hidden_out, per_seq, size)
                if logits is not None:
                    return logits
        return self.model.forward(
            ids,
            pos,
            self.kv_caches,
            meta,
            torch.from_numpy(logits_rows).to(dev),
            *(() if hidden_out is None else (hidden_out,)),
        )

    def capture_metadata(self, n: int, q: int = 1) -> AttentionMetadata:
        """A graph capture's attention metadata: n sequences of q tokens at positions
        0.., in the null block (which a capture never writes)."""
        positions = np.tile(np.arange(q, dtype=np.int64), n)
        table = np.zeros((n, -(-q // self.block_size)), dtype=np.int32)
        return attention_metadata(self.device, table, [0] * n, [q] * n, [q] * n, positions,
                                  np.zeros(n * q, dtype=np.int64),
                                  np.arange(0, n * q + 1, q, dtype=np.int32), self.block_size,
                                  [table] * (self.groups - 1))


def _nothing() -> tuple:
    """The host arrays of a step of no tokens."""
    none = np.zeros(0, dtype=np.int64)
    return (none, none, np.zeros((0, 1), dtype=np.int32), [], [], [], none,
            np.zeros(1, dtype=np.int32), [], none)


def block_table_of(tables: list[list[int]]) -> np.ndarray:
    """Block tables -> [num_seqs, width] int32, rows padded with the null block 0."""
    if len(tables) == 1:
        return np.asarray(tables, dtype=np.int32)
    table = np.zeros((len(tables), max(map(len, tables))), dtype=np.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    return table
