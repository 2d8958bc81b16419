"""Moving a request's KV between the engine's paged cache and the KV pool.

Two moments in a request's life, as in vLLM's KV-connector design:

    admission   the scheduler asks how many of the request's leading tokens, beyond
                its local prefix-cache hits, the pool can supply; it allocates blocks
                for them and the connector loads them (a decode instance loads a whole
                prefilled prompt this way; a prefill instance loads a shared prefix)
    prompt done the step that computes a request's last prompt token saves the prompt's
                blocks (full blocks, and the partial tail block) to the pool, and
                records their keys on the request

Pool keys are ``<fingerprint>/<hash>``: the chained block hash of the engine's prefix
cache for a full block, and, for the partial tail, the same chain extended by the tail's
tokens (a different byte length, so it never collides with a full block's key).
"""

from __future__ import annotations

import logging
import time

from pdmesh.shared.engine.block_manager import BlockHasher
from pdmesh.shared.engine.request import Request
from pdmesh.shared.kvpool.base import CacheRegions, KVPool

log = logging.getLogger(__name__)


class PoolConnector:
    def __init__(self, pool: KVPool, regions: CacheRegions, hasher: BlockHasher,
                 fingerprint: str, save_prompts: bool):
        self.pool = pool
        self.regions = regions
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.prefix = fingerprint
        self.save_prompts = save_prompts
        for t in regions.tensors:
            pool.register(t)
        # transfers, for metrics: direction -> [bytes, seconds of each transfer]
        self.transfer_bytes = {"put": 0, "get": 0}
        self.transfer_seconds: dict[str, list[float]] = {"put": [], "get": []}

    def take_transfer_seconds(self, direction: str) -> list[float]:
        """The transfer times recorded since the last call (the metrics collector's)."""
        taken, self.transfer_seconds[direction] = self.transfer_seconds[direction], []
        return taken

    def _account(self, direction: str, regions: list, ok: list[bool], seconds: float) -> None:
        self.transfer_bytes[direction] += sum(n for regs, done in zip(regions, ok, strict=True)
                                              if done for _, n in regs)
        times = self.transfer_seconds[direction]
        times.append(seconds)
        if len(times) > 4096:  # read and cleared by the metrics collector; bounded anyway
            del times[:2048]

    def prompt_keys(self, request: Request, num_tokens: int) -> list[str]:
        """Pool keys covering the request's first ``num_tokens`` tokens, in block order."""
        bs = self.block_size
        hashes = self.hasher.update(request)
        full = num_tokens // bs
        keys = [f"{self.prefix}/{h.hex()}" for h in hashes[:full]]
        tail = request.token_ids[full * bs:num_tokens]
        if tail:
            parent = hashes[full - 1] if full else self.hasher.root
            keys.append(f"{self.prefix}/{self.hasher.hash_block(parent, tail).hex()}")
        return keys

    def loadable_tokens(self, request: Request, local_tokens: int) -> int:
        """Tokens past ``local_tokens`` (block aligned) that the pool can supply, leaving
        the last token to compute."""
        limit = request.num_tokens - 1
        if limit <= local_tokens:
            return 0
        keys = self.prompt_keys(request, limit)
        first = local_tokens // self.block_size
        try:
            hits = self.pool.prefix_hits(keys[first:])
        except ConnectionError as e:  # the pool is down: compute everything here
            log.warning("request %s: pool lookup failed (%s)", request.request_id, e)
            return 0
        return min(limit, (first + hits) * self.block_size) - local_tokens

    def load(self, request: Request, block_ids: list[int], start_token: int,
             num_tokens: int) -> bool:
        """Copy tokens [start_token, start_token + num_tokens) in from the pool."""
        bs = self.block_size
        first, end = start_token // bs, start_token + num_tokens
        keys = self.prompt_keys(request, end)[first:]
        regions = [self.regions.regions(block_ids[first + i]) for i in range(len(keys))]
        t0 = time.perf_counter()
        try:
            ok = self.pool.get(keys, regions)
        except ConnectionError as e:
            log.warning("request %s: pool load failed (%s); recomputing", request.request_id, e)
            return False
        self._account("get", regions, ok, time.perf_counter() - t0)
        if not all(ok):
            log.warning("request %s: %d of %d blocks vanished from the pool; recomputing",
                        request.request_id, len(ok) - sum(ok), len(ok))
            return False
        return True

    def save(self, request: Request, block_ids: list[int]) -> list[str]:
        """Put the prompt's blocks in the pool; returns their keys (all of them, also
        those the pool already had)."""
        # the prompt, and any output tokens the request came with (a re-prefill)
        keys = self.prompt_keys(request, request.num_tokens)
        regions = [self.regions.regions(b) for b in block_ids[:len(keys)]]
        t0 = time.perf_counter()
        try:
            stored = self.pool.put(keys, regions)
        except ConnectionError as e:  # decode will find nothing and compute the prompt
            log.warning("request %s: pool save failed (%s)", request.request_id, e)
            return keys
        self._account("put", regions, stored, time.perf_counter() - t0)
        if not all(stored):
            log.warning("request %s: pool refused %d of %d blocks", request.request_id,
                        len(stored) - sum(stored), len(stored))
        return keys
