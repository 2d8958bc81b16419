"""What a model keeps in the paged cache: groups of tensors that share a block table.

Every group is paged by the same token blocks (block ``j`` of a request covers its
tokens ``j*bs .. (j+1)*bs - 1``), but each group has its own pool of blocks and its own
block table, because the groups keep different things for different spans:

    full        every block, for the request's whole life: K and V of each layer
                (Llama, Qwen), MLA's latent (DeepSeek-V3), or DeepSeek-V4's compressed
                entries and indexer keys (one slot per entry, ``rate`` tokens each)
    sliding     only the blocks that hold the last ``window`` tokens before the next one
                to compute; older blocks go back to the pool (their table entries read
                the null block): DeepSeek-V4's window K=V and its compressors' inputs

A tensor is [num_blocks + 1, slots, heads, dim]; block 0 is the null block. A token
tensor has ``block_size`` slots per block; a compressed tensor of rate ``m`` keeps the
entry of window ``w`` (tokens ``w*m .. (w+1)*m - 1``) in the block of the window's last
token, slot ``w % slots`` with ``slots = max(1, block_size // m)``: the entry becomes
findable, and cacheable, with the block that completes it.

    block_size 16, rate 4:   block j holds the entries of windows 4j .. 4j + 3
    block_size 16, rate 64:  the entry of window w sits in block 4w + 3, slot 0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdmesh.shared.models.config import CSA, ModelConfig

NULL_BLOCK_ID = 0
FULL, SLIDING = "full", "sliding"


@dataclass(frozen=True)
class CacheTensor:
    layer: int
    role: str  # k | v | latent | window | state | index_state | entries | index_keys
    slots: int  # per block
    dim: int
    heads: int = 1
    float32: bool = False  # kept in float32 whatever the model's dtype (compressor inputs)
    int8: bool = False  # --kv-cache-dtype int8: its scales are the role + "_scale" tensor

    def dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.int8 if self.int8 else torch.float32 if self.float32 else model_dtype

    def block_bytes(self, model_dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=self.dtype(model_dtype)).element_size()
        return self.slots * self.heads * self.dim * elem


@dataclass(frozen=True)
class CacheGroup:
    name: str
    kind: str  # FULL | SLIDING
    tensors: tuple[CacheTensor, ...]
    window: int = 0  # SLIDING: tokens behind the next token to compute that must stay

    def block_bytes(self, model_dtype: torch.dtype) -> int:
        return sum(t.block_bytes(model_dtype) for t in self.tensors)

    def first_needed_block(self, next_token: int, block_size: int) -> int:
        """The oldest block the request still needs when its next token is
        ``next_token`` (0 for a full group)."""
        if self.kind == FULL:
            return 0
        return max(0, next_token - self.window) // block_size


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int
    groups: tuple[CacheGroup, ...]  # groups[0] is the request's history (a FULL group)

    def layout(self) -> str:
        """The layout part of the cache fingerprint: two engines exchange blocks only if
        every tensor of every group agrees."""
        return ";".join(
            f"{g.name}:{g.kind}:{g.window}:" + ",".join(
                f"{t.layer}.{t.role}.{t.slots}x{t.heads}x{t.dim}{'f' if t.float32 else ''}"
                f"{'q' if t.int8 else ''}"
                for t in g.tensors)
            for g in self.groups)

    def bytes_per_token(self, model_dtype: torch.dtype) -> float:
        """What the history (full) groups take per token of context; sliding groups hold
        a fixed number of blocks per request instead (``window_bytes``)."""
        return sum(g.block_bytes(model_dtype) for g in self.groups
                   if g.kind == FULL) / self.block_size

    def window_blocks(self, group: CacheGroup, chunk: int = 1) -> int:
        """Blocks one request holds in a sliding group while computing ``chunk`` tokens."""
        return -(-(group.window + chunk) // self.block_size) + 1

    def window_bytes(self, model_dtype: torch.dtype) -> int:
        """What the sliding groups hold per decoding request."""
        return sum(self.window_blocks(g) * g.block_bytes(model_dtype) for g in self.groups
                   if g.kind == SLIDING)


def cache_spec(cfg: ModelConfig, block_size: int, mtp_layers: int = 0,
               int8: bool = False) -> KVCacheSpec:
    """``mtp_layers``: MTP layers that run as a proposer keep their KV as layers
    ``num_layers ..`` in the request's own blocks (DeepSeek-V4's, sliding-window, in the
    window group). ``int8``: K and V (MLA: the latent; DeepSeek-V4: the window K=V, the
    compressed entries and the indexer keys) in int8, each token's heads with a float32
    scale in a tensor of their own (role + "_scale"), in the same blocks, so the pool and
    the prefix cache carry them along."""
    if cfg.v4 is None:
        roles = ("latent",) if cfg.mla is not None else ("k", "v")
        tensors: list[CacheTensor] = []
        for i in range(cfg.num_layers + mtp_layers):
            for role in roles:
                tensors.append(CacheTensor(i, role, block_size, cfg.kv_cache_dim,
                                           cfg.kv_cache_heads, int8=int8))
                if int8:
                    tensors.append(CacheTensor(i, role + "_scale", block_size, 1,
                                               cfg.kv_cache_heads, float32=True))
        return KVCacheSpec(block_size, (CacheGroup("kv", FULL, tuple(tensors)),))
    v4 = cfg.v4
    history: list[CacheTensor] = []
    window: list[CacheTensor] = []

    def kv(layer: int, role: str, slots: int, dim: int) -> list[CacheTensor]:
        """A K=V tensor (window K=V, compressed entries, indexer keys), and under int8
        its scales; the compressors' float32 inputs stay float32."""
        return [CacheTensor(layer, role, slots, dim, int8=int8)] + (
            [CacheTensor(layer, role + "_scale", slots, 1, float32=True)] if int8 else [])

    for i, (kind, rate) in enumerate(zip(v4.layer_types, v4.compress_rates, strict=True)):
        window += kv(i, "window", block_size, v4.head_dim)
        if not rate:
            continue
        if rate % block_size and block_size % rate:
            raise ValueError(f"block_size: {block_size} and the compress rate {rate} of layer "
                             f"{i} must divide one another")
        slots = max(1, block_size // rate)
        overlap = 2 if kind == CSA else 1
        # per token: the compressor's kv and gate (+ position bias), both halves for CSA
        window.append(CacheTensor(i, "state", block_size, 2 * overlap * v4.head_dim,
                                  float32=True))
        history += kv(i, "entries", slots, v4.head_dim)
        if kind == CSA:
            window.append(CacheTensor(i, "index_state", block_size, 4 * v4.index_head_dim,
                                      float32=True))
            history += kv(i, "index_keys", slots, v4.index_head_dim)
    # MTP blocks attend their sliding window only: their K=V beside the layers'
    for i in range(mtp_layers):
        window += kv(cfg.num_layers + i, "window", block_size, v4.head_dim)
    # (sliding layers only: the history group holds no tensor, only the bookkeeping)
    return KVCacheSpec(block_size, (
        CacheGroup("compressed", FULL, tuple(history)),
        CacheGroup("window", SLIDING, tuple(window), window=v4.state_window)))


def allocate_caches(spec: KVCacheSpec, num_blocks: list[int], dtype: torch.dtype,
                    device: torch.device) -> list[list[torch.Tensor]]:
    """Per group, its tensors (in ``group.tensors`` order), each
    [num_blocks + 1, slots, heads, dim] with the null block zeroed: a slot is read only
    after it was written, or is padding redirected to the null block (masked, and
    finite, since NaN * 0 would still be NaN). On cpu the rest is left untouched: its
    pages become resident as blocks are first written (the prefix cache's LRU order
    reaches every block in time, so an engine's memory grows to its whole cache, then
    stays). Zeroing it all here, as vLLM does, made that flat from the start but held
    every engine's whole cache at once: the test suite's engines ran this box out of
    memory (issue 41, session 29)."""
    out = []
    for g, n in zip(spec.groups, num_blocks, strict=True):
        tensors = []
        for t in g.tensors:
            x = torch.empty((n + 1, t.slots, t.heads, t.dim), dtype=t.dtype(dtype), device=device)
            x[NULL_BLOCK_ID].zero_()
            tensors.append(x)
        out.append(tensors)
    return out


def layer_caches(spec: KVCacheSpec, caches: list[list[torch.Tensor]], num_layers: int
                 ) -> list[dict[str, torch.Tensor]]:
    """Per layer, its tensors by role."""
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
    for g, tensors in zip(spec.groups, caches, strict=True):
        for t, x in zip(g.tensors, tensors, strict=True):
            layers[t.layer][t.role] = x
    return layers
