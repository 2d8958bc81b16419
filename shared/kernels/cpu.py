"""CPU backend: vectorized torch, one batched call per op, no per-token Python loops.

Attention runs the C kernels in cpu_ops.c, every sequence's K / V blocks read in place
through its block table with an online softmax; float32, bfloat16, float16 and int8 caches
(the int8 dequantized as read), MLA's latent cache. No gathered copy, no padding to the
longest sequence, no mask:

- decode (one new token per sequence): the query heads of a KV head together;
- prefill (fresh prompts, chunks after their context, speculative verification's few
  tokens), where the CPU has AVX-512: tiles of a sequence's queries, every query head of
  a KV head in the lanes, each K / V chunk read once per tile, causal within the chunk.

Where the kernels are not built (no C compiler), a cache they cannot read, prefill on a
CPU without AVX-512, or on the cuda backend, attention reads each sequence's keys as a
dense [B, KVH, L, D] view and runs torch's fused scaled-dot-product attention:

- a lone sequence whose blocks are consecutive is a plain slice of the cache (no copy);
- decode steps read a mirror of the batch's keys carried over from the previous step,
  one row appended per sequence (:mod:`pdmesh.shared.kernels.decode_mirror`);
- anything else gathers the blocks' rows (indices and masks built once per step with
  numpy and reused by every layer).

Grouped-query attention folds the query heads that share a KV head into the
query-length axis, so K/V are never repeated:

    q [B, H, Lq, D]  ->  [B, KVH, G*Lq, D]   (G = H / KVH)
    k [B, KVH, Lk, D]                         (as read, no copy per query head)
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import torch
import torch.nn.functional as F

from pdmesh.shared.kernels import cpu_ops
from pdmesh.shared.kernels.base import AttentionMetadata
from pdmesh.shared.kernels.cpu_projections import CPUProjections
from pdmesh.shared.kernels.decode_mirror import DecodeKVMirror

log = logging.getLogger(__name__)
# A step whose sequences each compute at most this many tokens (one and up to 16 drafts
# to verify) attends as decode rows, one per token, in one batched call; while the rows
# times the longest sequence stay below AS_DECODE_MAX_KEYS (the gathered keys' count)
AS_DECODE_MAX_QUERY = 17
AS_DECODE_MAX_KEYS = 1 << 20
# ... where the C prefill kernel is built, only while a step's query rows per KV head
# (queries x query heads of one KV head) stay below its tiles' rows from which its lanes
# pay (cpu_ops.c's LANES_FROM_ROWS)
TILE_ROWS_FROM = 12
class CPUBackend(CPUProjections):
    """Projections (``CPUProjections``) and attention, norms, rotary, sampling here."""

    name = "cpu"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)  # (the C library: self._ops)
        _keep_freed_memory()
        self._mirror = DecodeKVMirror()
        # decode attention read in place through the block tables (cpu_ops.c); host
        # memory only (the cuda backend decodes through the dense path below)
        self._paged = (device.type == "cpu" and self._ops is not None
                       and hasattr(self._ops, "pdmesh_paged_decode"))
        # prefill attention read in place too, where the CPU has AVX-512 (without it the
        # kernel's chunk steps alone measured 2.7-5x torch's SDPA: the path below stays)
        self._paged_prefill = (self._paged and hasattr(self._ops, "pdmesh_paged_prefill")
                               and bool(self._ops.pdmesh_paged_prefill_supported()))
        # True: the paths a CPU without AVX-512 takes, where it has them (tests): the decode
        # kernel's portable chunk steps, torch's prefill attention
        self.portable_decode = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return super().rms_norm(x, weight, eps)

    def head_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), None, eps) * weight
        return super().head_rms_norm(x, weight, eps)

    def rotary_tables(
        self, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Fold rotate-half's sign into sin: cat(-x2, x1) * sin == roll(x, D/2) * sin_signed
        # with the first half of sin negated. Exactly the same arithmetic, two fewer ops.
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    def rotary_embedding(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        if x.dtype != cos.dtype:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)
        return torch.addcmul(x * cos.unsqueeze(1), rolled, sin.unsqueeze(1))

    def silu_and_mul(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        # In place in the caller's temporary: no new [T, I] buffers, one pass less.
        gate, up = x.chunk(2, dim=-1)
        if limit:
            gate.clamp_(max=limit)
            up.clamp_(-limit, limit)
        return F.silu(gate, inplace=True).mul_(up)  # [T, I] view, row stride 2I

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        # numpy's vectorized argmax is ~10x torch's CPU reduction for [32, 4096]
        return torch.from_numpy(logits.numpy().argmax(axis=-1))

    def prepare_attention(self, meta: AttentionMetadata) -> None:
        """Gather slots and masks for every layer, built with numpy on the host (a few
        microseconds, against tens for the same handful of small torch ops)."""
        state = meta.backend_state
        bs = meta.block_size
        seq_lens = np.asarray(meta.seq_lens_host)
        tables = meta.block_tables_host
        if tables is None:
            tables = meta.block_tables.cpu().numpy()
        if not meta.is_decode:
            self._mirror.invalidate()
        if meta.num_seqs == 1:
            used = tables[0, : -(-meta.max_seq_len // bs)]
            if used.size == 1 or bool((np.diff(used) == 1).all()):
                # one sequence in consecutive blocks: its keys are a slice of the cache
                state["key_range"] = (int(used[0]) * bs, meta.max_seq_len)
                state["mask"] = None
                if meta.is_decode:
                    self._mirror.invalidate()
                    return
        if meta.is_decode:
            if not self._paged:  # (the C kernel reads the block tables as they are)
                self._plan_dense_decode(meta, tables, seq_lens)
            return
        qlens = np.asarray(meta.query_lens_host)
        if self._paged_prefill and not self.portable_decode:
            # every sequence's queries over the cache in place, one C call for the step
            # (cpu_ops.c: tiles of queries, each K / V chunk read once per tile)
            state["paged_prefill"] = (
                np.ascontiguousarray(tables, dtype=np.int32),
                np.ascontiguousarray(seq_lens, dtype=np.int32),
                np.ascontiguousarray(np.cumsum(qlens) - qlens, dtype=np.int32),
                np.ascontiguousarray(qlens, dtype=np.int32))
            if self._as_decode(meta):  # (kept for a step of few query rows: see below)
                state["as_decode"] = self._token_rows(meta, tables, seq_lens, qlens)
            return
        self._plan_gathered(meta, tables, seq_lens, qlens)

    def _as_decode(self, meta: AttentionMetadata) -> bool:
        """A few tokens per sequence (speculative verification, short chunks): each token
        a decode row over the keys up to itself, one batched call."""
        return (meta.num_seqs > 1 and meta.max_query_len <= AS_DECODE_MAX_QUERY
                and meta.num_tokens * meta.max_seq_len <= AS_DECODE_MAX_KEYS)

    def _plan_gathered(self, meta: AttentionMetadata, tables: np.ndarray,
                       seq_lens: np.ndarray, qlens: np.ndarray) -> None:
        """A prefill step without the C kernel: fresh prompts of one length in one
        batched causal call (no plan), a few tokens per sequence as decode rows, anything
        else sequence by sequence (varlen): no padding to the longest, no [B, Lq, Lk]
        mask; a chunk after context gets its own [Lq, Lk] causal mask over its keys
        gathered (or sliced where its blocks are consecutive)."""
        state = meta.backend_state
        if not meta.has_context and (qlens.size == 0 or bool((qlens == qlens[0]).all())):
            return
        if self._as_decode(meta):
            state["as_decode"] = self._token_rows(meta, tables, seq_lens, qlens)
            return
        bs = meta.block_size
        ctx = np.asarray(meta.context_lens_host)
        starts = np.cumsum(qlens) - qlens
        plan = []
        for b in range(meta.num_seqs):
            ql, c, sl = int(qlens[b]), int(ctx[b]), int(seq_lens[b])
            keys: tuple[int, int] | torch.Tensor | None = None  # (a fresh prompt: k / v)
            mask = None
            if c:
                used = tables[b, : -(-sl // bs)]
                if used.size == 1 or bool((np.diff(used) == 1).all()):
                    keys = (int(used[0]) * bs, sl)
                else:
                    pos = np.arange(sl)
                    keys = torch.from_numpy(used[pos // bs].astype(np.int64) * bs
                                            + pos % bs).to(self.device)
                if ql > 1:  # query i sees keys j <= c + i
                    mask = _additive(np.arange(sl)[None, :] <= c + np.arange(ql)[:, None],
                                     self.device)
            plan.append((int(starts[b]), ql, c, keys, mask))
        state["varlen"] = plan

    def _plan_dense_decode(self, meta: AttentionMetadata, tables: np.ndarray,
                           seq_lens: np.ndarray) -> None:
        """Decode without the C kernel: masks for the dense keys, and the mirror."""
        state = meta.backend_state
        ragged = bool(seq_lens.min() < meta.max_seq_len)
        in_seq = np.arange(meta.max_seq_len) < seq_lens[:, None]  # [B, Lk]
        # [B, 1, 1, Lk] additive mask (faster than a boolean one in torch's CPU flash
        # attention); none at all when every sequence has the same length
        state["mask"] = _additive(in_seq[:, None, None, :], self.device) if ragged else None
        if not state.get("transient_caches"):  # (int8 views are new every layer)
            state["mirror"] = self._mirror.plan(tables, seq_lens, meta.block_size,
                                                meta.slot_mapping, self.device)

    def _token_rows(self, meta: AttentionMetadata, tables: np.ndarray, seq_lens: np.ndarray,
                    qlens: np.ndarray) -> AttentionMetadata:
        """The step as decode metadata with one row per token: token j of sequence b
        attends over the first ``seq_lens[b] - qlens[b] + j + 1`` keys (its own KV is in
        the cache already: every layer writes before it attends)."""
        seq = np.repeat(np.arange(meta.num_seqs), qlens)
        first = np.repeat(np.cumsum(qlens) - qlens, qlens)
        lens = np.repeat(seq_lens - qlens, qlens) + np.arange(len(seq)) - first + 1
        rows = np.ascontiguousarray(tables[seq])
        n = len(seq)
        sub = AttentionMetadata(
            slot_mapping=meta.slot_mapping,
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=self.device),
            seq_lens=torch.from_numpy(lens.astype(np.int32)).to(self.device),
            context_lens=torch.from_numpy((lens - 1).astype(np.int32)).to(self.device),
            block_tables=torch.from_numpy(rows).to(self.device),
            query_lens_host=[1] * n, seq_lens_host=lens.tolist(),
            context_lens_host=(lens - 1).tolist(), max_query_len=1,
            max_seq_len=meta.max_seq_len, block_size=meta.block_size,
            block_tables_host=rows)
        if not self._paged:
            ragged = bool(lens.min() < meta.max_seq_len)
            in_seq = np.arange(meta.max_seq_len) < lens[:, None]
            sub.backend_state["mask"] = (_additive(in_seq[:, None, None, :], self.device)
                                         if ragged else None)
        return sub

    def _key_slots(self, meta: AttentionMetadata) -> torch.Tensor:
        """[B, Lk] cache slot of every key of every sequence, built once per step."""
        state = meta.backend_state
        if "key_slots" not in state:
            bs = meta.block_size
            tables = meta.block_tables_host
            if tables is None:
                tables = meta.block_tables.cpu().numpy()
            seq_lens = np.asarray(meta.seq_lens_host)
            key_pos = np.arange(meta.max_seq_len)
            slots = tables[:, key_pos // bs].astype(np.int64) * bs + key_pos % bs
            # keys past a sequence's end read the zeroed null block, not stale data
            slots = np.where(key_pos < seq_lens[:, None], slots, 0)
            state["key_slots"] = torch.from_numpy(np.ascontiguousarray(slots)).to(self.device)
        return state["key_slots"]

    def _gather(self, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Paged cache -> [B, KVH, Lk, D] for this step's sequences."""
        num_blocks, bs, kvh, d = cache.shape
        flat = cache.view(num_blocks * bs, kvh, d)
        key_range = meta.backend_state.get("key_range")
        if key_range is not None:  # no copy at all
            start, length = key_range
            return flat[start:start + length].unsqueeze(0).transpose(1, 2)
        slots = self._key_slots(meta)  # [B, Lk]
        # index_select on the flat slot axis is several times faster than fancy indexing
        rows = flat.index_select(0, slots.view(-1))
        return rows.view(slots.shape[0], slots.shape[1], kvh, d).transpose(1, 2)

    def paged_attention_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        state = meta.backend_state
        in_place = state.get("paged_prefill")
        if in_place is not None:
            rows = meta.max_query_len * (q.shape[1] // k_cache.shape[2])
            if "as_decode" in state and rows < TILE_ROWS_FROM:
                return self.paged_attention_decode(q, k_cache, v_cache, state["as_decode"],
                                                   scale)
            if self._reads_in_place((k_cache, v_cache)):
                return self._prefill_in_place(q, k_cache, v_cache, meta, scale)
            state.pop("paged_prefill")  # (a cache the kernel cannot read: gathered)
            state.pop("as_decode", None)
            tables = meta.block_tables_host
            self._plan_gathered(meta, meta.block_tables.cpu().numpy() if tables is None
                                else tables, np.asarray(meta.seq_lens_host),
                                np.asarray(meta.query_lens_host))
        plan = state.get("varlen")
        if plan is not None:
            return self._varlen_prefill(q, k, v, k_cache, v_cache, plan, scale)
        rows = meta.backend_state.get("as_decode")
        if rows is not None:
            return self.paged_attention_decode(q, k_cache, v_cache, rows, scale)
        # fresh prompts of one length (prepare_attention plans every other step varlen):
        # this step's k/v are the whole sequences, one batched causal call
        b = meta.num_seqs
        out = F.scaled_dot_product_attention(
            *(x.view(b, -1, *x.shape[1:]).transpose(1, 2) for x in (q, k, v)),
            is_causal=True, scale=scale, enable_gqa=True,
        )  # [B, H, L, D]
        return out.transpose(1, 2).reshape(q.shape)

    def paged_attention_prefill_int8(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        caches: tuple[torch.Tensor, torch.Tensor], scales: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        if "paged_prefill" in meta.backend_state and self._reads_in_place(caches, scales):
            return self._prefill_in_place(q, *caches, meta, scale, scales=scales)
        return super().paged_attention_prefill_int8(q, k, v, caches, scales, meta, scale)

    def latent_attention_prefill_int8(
        self, q: torch.Tensor, entry: torch.Tensor, cache: torch.Tensor,
        cache_scale: torch.Tensor, meta: AttentionMetadata, scale: float, value_dim: int,
    ) -> torch.Tensor:
        if "paged_prefill" in meta.backend_state and self._reads_in_place((cache,),
                                                                           (cache_scale,)):
            return self._prefill_in_place(q, cache, cache, meta, scale, value_dim,
                                          scales=(cache_scale, cache_scale))
        return super().latent_attention_prefill_int8(q, entry, cache, cache_scale, meta,
                                                     scale, value_dim)

    def _prefill_in_place(self, q: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                          value_dim: int | None = None,
                          scales: tuple[torch.Tensor, torch.Tensor] | None = None
                          ) -> torch.Tensor:
        """q [T, H, D], every sequence's queries, over the caches in place (cpu_ops.c;
        this step's keys are in them already) -> [T, H, value_dim]. ``scales``: an int8
        cache's per-token-and-head scales (k, v)."""
        tables, lens, qstart, qlens = meta.backend_state["paged_prefill"]
        base, out, _q = self._kernel_args(q, k_cache, v_cache, tables, lens, meta, scale,
                                          value_dim, scales)
        args = cpu_ops.PagedPrefillArgs(base, qstart.ctypes.data, qlens.ctypes.data)
        if self._ops.pdmesh_paged_prefill(ctypes.byref(args)) != 0:
            raise MemoryError("paged prefill attention: no memory for its scratch")
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def _varlen_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, plan: list,
                        scale: float) -> torch.Tensor:
        """Each sequence on its own: its queries [1, H, Lq, D] over its own keys only
        (this step's k/v for a fresh prompt, else the cache's), causal."""
        out = torch.empty_like(q)
        kvh, d = k_cache.shape[2], k_cache.shape[3]
        k_flat, v_flat = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
        for start, ql, ctx, keys, mask in plan:
            qs = q[start:start + ql].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
            if not ctx:
                ks, vs = k[start:start + ql], v[start:start + ql]
            elif isinstance(keys, tuple):
                lo, n = keys
                ks, vs = k_flat[lo:lo + n], v_flat[lo:lo + n]
            else:
                ks, vs = k_flat.index_select(0, keys), v_flat.index_select(0, keys)
            o = F.scaled_dot_product_attention(
                qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                attn_mask=None if mask is None else mask.to(q.dtype),
                is_causal=not ctx and ql > 1, scale=scale, enable_gqa=True)
            out[start:start + ql] = o[0].transpose(0, 1)
        return out

    def paged_attention_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if self._reads_in_place((k_cache, v_cache)):
            return self._paged_decode(q, k_cache, v_cache, meta, scale)
        b, h, d = q.shape
        kvh = k_cache.shape[2]
        qg = q.view(b, kvh, h // kvh, d)  # query heads of one KV head side by side
        if "mask" not in meta.backend_state:  # (planned for the C kernel: a cache it cannot read)
            tables = meta.block_tables_host
            self._plan_dense_decode(meta, meta.block_tables.cpu().numpy() if tables is None
                                    else tables, np.asarray(meta.seq_lens_host))
        mask = meta.backend_state["mask"]
        kv = None
        plan = meta.backend_state.get("mirror")
        if plan is not None:
            kv = self._mirror.kv(k_cache, v_cache, plan, meta.max_seq_len)
        if kv is None:
            kv = self._gather(k_cache, meta), self._gather(v_cache, meta)
        out = F.scaled_dot_product_attention(
            qg,
            *kv,
            attn_mask=None if mask is None else mask.to(q.dtype),
            scale=scale,
        )
        return out.reshape(b, h, d)

    def latent_attention_prefill(self, q: torch.Tensor, entry: torch.Tensor,
                                 cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                                 value_dim: int) -> torch.Tensor:
        if "paged_prefill" in meta.backend_state and self._reads_in_place((cache,)):
            return self._prefill_in_place(q, cache, cache, meta, scale, value_dim)
        return super().latent_attention_prefill(q, entry, cache, meta, scale, value_dim)

    def latent_attention_decode(self, q: torch.Tensor, cache: torch.Tensor,
                                meta: AttentionMetadata, scale: float, value_dim: int
                                ) -> torch.Tensor:
        if self._reads_in_place((cache,)):
            return self._paged_decode(q, cache, cache, meta, scale, value_dim)
        return super().latent_attention_decode(q, cache, meta, scale, value_dim)

    def paged_attention_decode_int8(
        self, q: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor],
        scales: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        if self._reads_in_place(caches, scales):
            return self._paged_decode(q, *caches, meta, scale, scales=scales)
        return super().paged_attention_decode_int8(q, caches, scales, meta, scale)

    def latent_attention_decode_int8(
        self, q: torch.Tensor, cache: torch.Tensor, cache_scale: torch.Tensor,
        meta: AttentionMetadata, scale: float, value_dim: int,
    ) -> torch.Tensor:
        if self._reads_in_place((cache,), (cache_scale,)):
            return self._paged_decode(q, cache, cache, meta, scale, value_dim,
                                      scales=(cache_scale, cache_scale))
        return super().latent_attention_decode_int8(q, cache, cache_scale, meta, scale,
                                                    value_dim)

    def _reads_in_place(self, caches: tuple[torch.Tensor, ...],
                        scales: tuple[torch.Tensor, ...] | None = None) -> bool:
        """The C kernel takes these caches: float ones alone, int8 ones with their float32
        scales; contiguous, of one dtype."""
        if not self._paged or not all(c.is_contiguous() and c.dtype == caches[0].dtype
                                      for c in caches):
            return False
        if caches[0].dtype == torch.int8:
            return scales is not None and all(s.dtype == torch.float32 and s.is_contiguous()
                                              for s in scales)
        return scales is None and caches[0].dtype in cpu_ops.PAGED_DECODE_DTYPES

    def _paged_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, value_dim: int | None = None,
                      scales: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> torch.Tensor:
        """q [B, H, D] over the caches in place (cpu_ops.c): -> [B, H, value_dim]
        (value_dim: the value rows' first dims, MLA's latent; else all of them).
        ``scales``: an int8 cache's per-token-and-head scales (k, v)."""
        state = meta.backend_state
        if "paged" not in state:  # once a step: every layer reads the same tables
            tables = meta.block_tables_host
            if tables is None:
                tables = meta.block_tables.cpu().numpy()
            state["paged"] = (np.ascontiguousarray(tables, dtype=np.int32),
                              np.ascontiguousarray(meta.seq_lens_host, dtype=np.int32))
        tables, lens = state["paged"]
        args, out, _q = self._kernel_args(q, k_cache, v_cache, tables, lens, meta, scale,
                                          value_dim, scales)
        if self._ops.pdmesh_paged_decode(ctypes.byref(args)) != 0:
            raise MemoryError("paged decode attention: no memory for its scratch")
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def _kernel_args(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: np.ndarray, lens: np.ndarray, meta: AttentionMetadata,
                     scale: float, value_dim: int | None,
                     scales: tuple[torch.Tensor, torch.Tensor] | None
                     ) -> tuple[cpu_ops.PagedDecodeArgs, torch.Tensor, torch.Tensor]:
        """cpu_ops.c's paged_decode_args for query rows q [N, H, D] over the caches in
        place (the sequences ``lens`` lists, their ``tables``); the float32 output
        [N, H, value_dim] they write (the value rows' first dims, MLA's latent; else all
        of them); and the query rows the kernel reads (q itself where it is float32 heads
        side by side: a slice of the step's q / k projection as it is), to be kept until
        the call."""
        n, h, d = q.shape
        kvh, v_row = k_cache.shape[2], v_cache.shape[3]
        vd = v_row if value_dim is None else value_dim
        qf = q
        if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != d:
            qf = q.float().contiguous()
        out = torch.empty((n, h, vd), dtype=torch.float32)
        k_scale, v_scale = (None, None) if scales is None else (
            scales[0].data_ptr(), scales[1].data_ptr())
        args = cpu_ops.PagedDecodeArgs(
            qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_scale, v_scale,
            tables.ctypes.data, lens.ctypes.data, out.data_ptr(), len(lens), h, kvh, d,
            v_row, vd, meta.block_size, tables.shape[1],
            cpu_ops.PAGED_DECODE_DTYPES[k_cache.dtype], qf.stride(0), int(self.portable_decode),
            scale)
        return args, out, qf

    def sink_attention_decode(
        self, q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor | None,
                                                   torch.Tensor, torch.Tensor]],
        sinks: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        # the listed rows read where they lie (cpu_ops.c), not gathered into [S, K, D]
        caches = tuple(c for c, _, _, _ in sources)
        scales = tuple(sc for _, sc, _, _ in sources)
        in_place = (self._paged and hasattr(self._ops, "pdmesh_sink_decode")
                    and 1 <= len(sources) <= 2
                    and self._reads_in_place(caches, None if scales[0] is None else scales))
        if not in_place or any((sc is None) != (scales[0] is None) for sc in scales):
            return super().sink_attention_decode(q, sources, sinks, scale)
        b, h, d = q.shape
        qf = q.float().contiguous()
        out = torch.empty((b, h, d), dtype=torch.float32)
        lists = [torch.where(visible, slots, -1).to(torch.int64).contiguous()
                 for _, _, slots, visible in sources]
        src = (cpu_ops.SlotSource * 2)(*[
            cpu_ops.SlotSource(cache.data_ptr(), None if sc is None else sc.data_ptr(),
                               listed.data_ptr(), listed.shape[1])
            for (cache, sc, _, _), listed in zip(sources, lists, strict=True)])
        sinks32 = sinks.float().contiguous()
        args = cpu_ops.SinkDecodeArgs(
            qf.data_ptr(), src, len(sources), sinks32.data_ptr(), out.data_ptr(), b, h, d,
            cpu_ops.PAGED_DECODE_DTYPES[caches[0].dtype], int(self.portable_decode), scale)
        if self._ops.pdmesh_sink_decode(ctypes.byref(args)) != 0:
            raise MemoryError("sink decode attention: no memory for its scratch")
        return out.to(q.dtype)

    def hc_sinkhorn(self, comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        # one C loop over every token's n x n matrix instead of ~6 x iters torch ops
        # (each a dispatch of a few microseconds on matrices of 16 numbers)
        if (self._ops is None or comb.dtype != torch.float32 or comb.device.type != "cpu"
                or comb.dim() != 3 or comb.shape[1] != comb.shape[2]):
            return super().hc_sinkhorn(comb, iters, eps)
        comb = comb.contiguous()
        self._ops.pdmesh_hc_sinkhorn_f32(ctypes.c_void_p(comb.data_ptr()), comb.shape[0],
                                         comb.shape[1], iters, eps)
        return comb


def _additive(visible: np.ndarray, device: torch.device) -> torch.Tensor:
    """Boolean visibility -> float32 mask of 0 / -inf."""
    return torch.from_numpy(np.where(visible, np.float32(0), np.float32(-np.inf))).to(device)


def _keep_freed_memory() -> None:
    """Stop glibc from returning large freed buffers to the OS after every step.

    Each step allocates and frees the same activation sizes; by default glibc unmaps
    (or trims) them, and the next step page-faults them back in (~10% of a prefill).
    vLLM's CPU build preloads tcmalloc for the same reason; this keeps glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    libc.mallopt(m_trim_threshold, 1 << 30)
    libc.mallopt(m_mmap_threshold, 1 << 30)
