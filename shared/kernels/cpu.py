"""CPU backend: vectorized torch, one batched call per op, no per-token Python loops.

Paged attention gathers each sequence's blocks into a padded [B, L] view once per layer
(the gather indices and masks are built once per step) and runs torch's fused
scaled-dot-product attention. Grouped-query attention folds the query heads that share a
KV head into the query-length axis, so K/V are never repeated:

    q [B, H, Lq, D]  ->  [B, KVH, G*Lq, D]   (G = H / KVH)
    k [B, KVH, Lk, D]                         (as gathered, no copy per query head)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.kernels.base import AttentionMetadata, KernelBackend


class CPUBackend(KernelBackend):
    name = "cpu"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return super().rms_norm(x, weight, eps)

    def prepare_attention(self, meta: AttentionMetadata) -> None:
        state = meta.backend_state
        bs = meta.block_size
        num_blocks = -(-meta.max_seq_len // bs)
        tables = meta.block_tables[:, :num_blocks].long()  # [B, nb]
        dev = meta.seq_lens.device
        offsets = torch.arange(bs, dtype=torch.long, device=dev)
        # slot of key j of sequence b: tables[b, j // bs] * bs + j % bs
        key_slots = (tables.unsqueeze(-1) * bs + offsets).reshape(meta.num_seqs, -1)
        key_pos = torch.arange(key_slots.shape[1], device=dev)
        seq_lens = meta.seq_lens.long()
        # Keys past a sequence's end read slot 0 (the zeroed null block), never stale data.
        in_seq = key_pos < seq_lens.unsqueeze(1)
        state["key_slots"] = torch.where(in_seq, key_slots, 0)  # [B, Lk]
        if meta.is_decode:
            # [B, 1, 1, Lk]: each sequence's one query sees its seq_len keys
            state["mask"] = in_seq.view(meta.num_seqs, 1, 1, -1)
            return
        # Varlen rows -> padded [B, Lq] and back.
        qlens = torch.tensor(meta.query_lens_host, dtype=torch.long, device=dev)
        q_pos = torch.arange(meta.max_query_len, device=dev)
        valid = q_pos < qlens.unsqueeze(1)  # [B, Lq]
        state["q_valid"] = valid
        state["q_rows"] = (meta.query_start_loc[:-1].long().unsqueeze(1) + q_pos)[valid]
        if meta.has_context:
            ctx = meta.context_lens.long()
            # key j visible to query i of sequence b iff j <= ctx_b + i and j < seq_len_b
            causal = key_pos.view(1, 1, -1) <= (ctx.view(-1, 1, 1) + q_pos.view(1, -1, 1))
            state["mask"] = (causal & (key_pos.view(1, 1, -1) < seq_lens.view(-1, 1, 1))
                             ).unsqueeze(1)  # [B, 1, Lq, Lk]

    def _pad(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[T, N, D] -> [B, N, Lq, D], zeros in padded rows."""
        state = meta.backend_state
        if meta.num_seqs == 1:
            return x.transpose(0, 1).unsqueeze(0)
        out = x.new_zeros((meta.num_seqs, meta.max_query_len, x.shape[1], x.shape[2]))
        out[state["q_valid"]] = x
        return out.transpose(1, 2)

    def _unpad(self, out: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[B, N, Lq, D] -> [T, N, D]."""
        out = out.transpose(1, 2)
        if meta.num_seqs == 1:
            return out[0]
        return out[meta.backend_state["q_valid"]]

    def _gather(self, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Paged cache -> [B, KVH, Lk, D] for this step's sequences."""
        num_blocks, bs, kvh, d = cache.shape
        slots = meta.backend_state["key_slots"]
        flat = cache.view(num_blocks * bs, kvh, d)
        return flat[slots].transpose(1, 2)

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
        qp = self._pad(q, meta)  # [B, H, Lq, D]
        if not meta.has_context:
            # Fresh prompts: this step's k/v are the whole sequence. Right padding sits
            # after every real query, so the causal mask already hides it.
            out = F.scaled_dot_product_attention(
                qp, self._pad(k, meta), self._pad(v, meta),
                is_causal=True, scale=scale, enable_gqa=True,
            )
            return self._unpad(out, meta)
        kp = self._gather(k_cache, meta)
        vp = self._gather(v_cache, meta)
        out = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=meta.backend_state["mask"], scale=scale, enable_gqa=True
        )
        return self._unpad(out, meta)

    def paged_attention_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        b, h, d = q.shape
        kvh = k_cache.shape[2]
        qg = q.view(b, kvh, h // kvh, d)  # query heads of one KV head side by side
        out = F.scaled_dot_product_attention(
            qg,
            self._gather(k_cache, meta),
            self._gather(v_cache, meta),
            attn_mask=meta.backend_state["mask"],
            scale=scale,
        )
        return out.reshape(b, h, d)
