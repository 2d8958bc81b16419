"""DeepSeek's multi-token prediction as a proposer (vLLM's "deepseek_mtp" / "mtp").

The MTP layer at position i reads the target's final hidden state h_i and token i + 1
and predicts token i + 2; it has a decoder layer, so a KV cache of its own. That cache
is one more layer in the request's own blocks (the engine's cache layout gains it, so a
prefill instance's pool blocks carry it to the decode instance):

    after each step      absorb: every position whose target KV the step computed and
                         kept (prompt chunks, the verified tokens) runs through the MTP
                         layer (h_i, token i + 1), writing its MTP KV; for a request
                         about to decode, the last one's logits give draft 1
    propose (k > 1)      chained as vLLM does: draft j + 1 from the MTP layer's own
                         output at draft j's position (hidden) and draft j (token),
                         its KV written ahead in the request's blocks and overwritten
                         with the real one once the target has computed that position

A step not absorbed (the engine drafts nothing after it, e.g. at high load) leaves its
requests' MTP KV with a gap; they are drafted for no more.

Drafts are the MTP head's argmax, verified as point masses (the target's distribution
is kept for any sampling). With several MTP layers, draft ``j`` (from 0) comes from layer
``j % num_mtp_layers``, as vLLM's model classes pick it. Each layer keeps its own KV, and
every position that one layer runs over (absorbed, or a chained draft's) runs through all
of them, so a layer attends over its own entries for every earlier position. vLLM runs
only the picked layer, which leaves the others' caches unwritten at those positions
(stale reads later); pdmesh does not replicate that. With one MTP layer (DeepSeek-V3's,
V4's) the two are the same computation.

The model is either kind: DeepSeek-V3's (``CausalLM``: the hidden state is the final
normed one, the KV the MTP layer's latent in the history group) or DeepSeek-V4's
(``DeepseekV4``: the hidden state is the layers' streams before the head collapses them,
the KV the MTP block's sliding window K=V in the window group); ``mtp_forward`` and
``StepRows`` hide which.
"""

from __future__ import annotations

import logging
import weakref

import numpy as np
import torch

from pdmesh.shared.engine.block_manager import KVCacheManager
from pdmesh.shared.engine.model_runner import StepRows, attention_metadata, block_table_of
from pdmesh.shared.engine.request import Request
from pdmesh.shared.engine.spec_decode import Drafts
from pdmesh.shared.kernels import KernelBackend
from pdmesh.shared.models.deepseek_v4 import DeepseekV4
from pdmesh.shared.models.transformer import CausalLM, KVCache

log = logging.getLogger(__name__)


class MtpProposer:
    needs_hidden = True

    def __init__(self, model: CausalLM | DeepseekV4, backend: KernelBackend, kv: KVCacheManager,
                 caches: list[KVCache], confidence: bool = False):
        """``caches``: each MTP layer's tensors; ``confidence``: also give each draft's
        max softmax (for dynamic verify budgets)."""
        if len(caches) != len(model.w.mtp):
            raise ValueError(f"caches: {len(caches)} for {len(model.w.mtp)} MTP layers")
        self.model = model
        self.backend = backend
        self.kv = kv
        self.caches = caches
        self.tp_ranks = None  # a tensor-parallel engine's: its workers run each MTP forward
        self.confidence = confidence
        self.block_size = kv.block_size
        # request -> (draft 1, its confidence, the MTP output hidden at its position)
        self._first: dict[Request, tuple[int, float, torch.Tensor]] = {}
        # requests whose MTP KV misses positions (steps not absorbed): drafted no more
        self._gapped: weakref.WeakSet[Request] = weakref.WeakSet()

    def skip(self, rows: StepRows) -> None:
        self._first = {}
        self._gapped.update(rows.requests)

    def can_draft(self, request: Request) -> bool:
        return request not in self._gapped

    def absorb(self, rows: StepRows, keep: set[int]) -> None:
        self._first = {}
        bs = self.block_size
        picked, ids, positions, hidden_rows, slots = [], [], [], [], []
        starts, counts, seqs, last = [], [], [], []
        for i, r in enumerate(rows.requests):
            if (r.is_finished and id(r) not in keep) or r in self._gapped:
                continue
            s = rows.starts[i]
            # positions computed and kept whose next token is known
            n = min(rows.counts[i], r.num_computed_tokens - s, r.num_tokens - 1 - s)
            if n <= 0:
                continue
            p = np.arange(s, s + n, dtype=np.int64)
            table = rows.tables[i]
            picked.append(r)
            ids.append(np.asarray(r.token_ids[s + 1:s + n + 1], dtype=np.int64))
            positions.append(p)
            hidden_rows.append(np.arange(rows.row_starts[i], rows.row_starts[i] + n))
            slots.append(table[p // bs].astype(np.int64) * bs + p % bs)
            starts.append(s)
            counts.append(n)
            seqs.append(i)
            last.append(not r.is_finished and s + n == r.num_tokens - 1)
        if not picked:
            return
        qsl = np.zeros(len(picked) + 1, dtype=np.int32)
        np.cumsum(counts, out=qsl[1:])
        want = [k for k, ok in enumerate(last) if ok]
        hidden = rows.hidden.index_select(
            0, torch.from_numpy(np.concatenate(hidden_rows)).to(rows.hidden.device))
        batch = (ids, positions, hidden, slots, starts, counts, rows.tables[seqs],
                 [t[seqs] for t in rows.group_tables], qsl)
        for index in range(1, len(self.caches)):  # the later layers' KV (no drafts)
            self._run(*batch, np.zeros(0, dtype=np.int64), index=index)
        logits, out = self._run(*batch, qsl[1:][want] - 1)
        tokens, conf = self._pick(logits)
        for n, k in enumerate(want):
            self._first[picked[k]] = (tokens[n], conf[n], out[int(qsl[k + 1]) - 1])

    def propose(self, requests: list[Request], k: int) -> list[Drafts]:
        drafts = {}
        chain: list[tuple[Request, torch.Tensor]] = []
        for r in requests:
            first = self._first.pop(r, None)
            if first is None:
                continue
            token, conf, h = first
            drafts[r] = Drafts([token], confidence=[conf] if self.confidence else None)
            # room for the chained drafts' MTP KV (positions num_tokens - 1 on)
            if k > 1 and self.kv.allocate(r, k - 1, register=False):
                chain.append((r, h))
        if chain:
            self._chain([r for r, _ in chain], torch.stack([h for _, h in chain]), drafts, k)
        self._first = {}
        return [drafts.get(r, Drafts([])) for r in requests]

    def _chain(self, reqs: list[Request], hidden: torch.Tensor, drafts: dict[Request, Drafts],
               k: int) -> None:
        """Drafts 2..k of ``reqs``, each from the MTP layer's own output at the draft
        before it (``hidden`` [R, H]: at draft 1), appended to ``drafts``."""
        bs = self.block_size
        # their blocks, allocated for the chain already, do not change between drafts
        table, *group_tables = (block_table_of([self.kv.block_ids(r, g) for r in reqs])
                                for g in range(len(self.kv.groups)))
        rows = np.arange(len(reqs))
        qsl = np.arange(len(reqs) + 1, dtype=np.int32)
        for step in range(1, k):
            p = [r.num_tokens - 2 + step for r in reqs]
            pos = np.asarray(p, dtype=np.int64)
            slots = table[rows, pos // bs].astype(np.int64) * bs + pos % bs
            batch = ([np.asarray([drafts[r].tokens[-1]]) for r in reqs], [pos], hidden,
                     [slots], p, [1] * len(reqs), table, group_tables, qsl)
            index = step % len(self.caches)
            for other in range(len(self.caches)):  # the other layers' KV at this position
                if other != index:
                    self._run(*batch, np.zeros(0, dtype=np.int64), index=other)
            logits, hidden = self._run(*batch, rows, index=index)
            tokens, conf = self._pick(logits)
            for n, r in enumerate(reqs):
                drafts[r].tokens.append(tokens[n])
                if self.confidence:
                    drafts[r].confidence.append(conf[n])

    def _run(self, ids: list[np.ndarray], positions: list[np.ndarray], hidden: torch.Tensor,
             slots: list[np.ndarray], starts: list[int], counts: list[int], table: np.ndarray,
             group_tables: list[np.ndarray], qsl: np.ndarray, logits_rows: np.ndarray,
             index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer ``index`` over one batch."""
        arrays = (np.concatenate(ids), np.concatenate(positions), np.concatenate(slots),
                  list(starts), list(counts), table, list(group_tables), qsl,
                  np.asarray(logits_rows, dtype=np.int64))
        if self.tp_ranks is not None:  # every tensor-parallel rank runs the MTP layer
            self.tp_ranks.broadcast(("mtp", (*arrays, hidden.cpu(), index)))
        return mtp_forward_arrays(self.model, self.backend, self.caches[index],
                                  self.block_size, hidden, *arrays, index=index)

    def _pick(self, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        tokens = self.backend.greedy(logits).tolist()
        if not self.confidence:
            return tokens, [1.0] * len(tokens)
        return tokens, torch.softmax(logits, dim=-1).amax(dim=-1).tolist()


def mtp_forward_arrays(model, backend: KernelBackend, cache: KVCache, block_size: int,
                       hidden: torch.Tensor, ids: np.ndarray, pos: np.ndarray,
                       slots: np.ndarray, starts: list[int], counts: list[int],
                       table: np.ndarray, group_tables: list[np.ndarray], qsl: np.ndarray,
                       logits_rows: np.ndarray, index: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP layer ``index`` over one batch given as host arrays (what the proposer builds
    and a tensor-parallel worker receives); ``cache``: that layer's."""
    dev = backend.device
    meta = attention_metadata(dev, table, starts, counts,
                              [s + n for s, n in zip(starts, counts, strict=True)], pos,
                              slots, qsl, block_size, group_tables)
    backend.prepare_attention(meta)
    return model.mtp_forward(index, torch.from_numpy(ids).to(dev),
                             torch.from_numpy(pos).to(dev),
                             hidden.to(dev), cache, meta, torch.from_numpy(logits_rows).to(dev))
