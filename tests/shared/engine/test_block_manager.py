"""Block pool, chained hashing and the KV-cache manager, without a model."""

from __future__ import annotations

import pytest

from pdmesh.shared.engine.block_manager import NULL_BLOCK_ID, BlockHasher, BlockPool, KVCacheManager
from pdmesh.shared.engine.request import Request
from pdmesh.shared.engine.sampling_params import SamplingParams


def req(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams())


def test_hash_chain_is_a_prefix_property_and_model_scoped():
    h = BlockHasher(4, fingerprint="model-a")
    a = req(list(range(10)), "a")
    b = req(list(range(8)) + [99, 98, 97], "b")
    ha, hb = list(h.update(a)), list(h.update(b))
    assert len(ha) == 2 and len(hb) == 2  # only full blocks are hashed
    assert ha == hb  # same first 8 tokens -> same two keys
    c = req([0, 1, 2, 3, 5, 5, 6, 7], "c")
    hc = h.update(c)
    assert hc[0] == ha[0] and hc[1] != ha[1]  # the chain diverges with the tokens
    d = req([4, 5, 6, 7, 4, 5, 6, 7], "d")
    hd = h.update(d)
    assert hd[0] != hd[1]  # same tokens, different parent -> different key
    other = BlockHasher(4, fingerprint="model-b").update(req(list(range(10)), "e"))
    assert other[0] != ha[0]
    # incremental: appending tokens extends the chain, never rewrites it
    a.append_token(10)
    a.append_token(11)
    assert h.update(a)[:2] == ha and len(a.block_hashes) == 3


def test_pool_never_hands_out_the_null_block_and_counts_refs():
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.allocate(5)
    assert NULL_BLOCK_ID not in {b.block_id for b in blocks}
    assert pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.touch(blocks[:2])  # a second owner
    pool.free(blocks)
    assert pool.num_free == 3
    pool.free(blocks[:2])
    assert pool.num_free == 5
    with pytest.raises(ValueError, match="num_kv_blocks"):
        BlockPool(0, enable_caching=True)


def test_freed_blocks_stay_cached_until_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = req(list(range(9)), "a")  # 2 full blocks + 1 token
    assert kv.find_cached_prefix(a) == []
    assert kv.allocate(a, 9)
    a.num_computed_tokens = 9
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = req(list(range(8)) + [50, 51], "b")
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2  # a's first two blocks, although a is gone
    # a new request with unrelated tokens takes the LRU free blocks first: a's tail
    # block was freed first (tail-first), then block 1, then block 0
    c = req([70] * 8, "c")
    assert kv.allocate(c, 8)
    assert len(kv.find_cached_prefix(b)) == 2  # the prefix blocks survived
    d = req([80] * 4, "d")
    assert kv.allocate(d, 4)  # now a prefix block is evicted
    assert len(kv.find_cached_prefix(b)) < 2


def test_whole_prompt_hit_still_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = req(list(range(8)), "a")
    assert kv.allocate(a, 8)
    kv.free(a)
    again = req(list(range(8)), "again")
    assert len(kv.find_cached_prefix(again)) == 1  # (8 - 1) // 4 blocks at most


def test_allocate_failure_changes_nothing_and_counts_reclaimed_hits():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    a = req(list(range(8)), "a")
    assert kv.allocate(a, 8)
    kv.free(a)
    b = req(list(range(8)) + list(range(100, 108)), "b")  # 4 blocks, 2 cached
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2
    # needs 2 more blocks, but only 1 is free once the 2 hits are taken back
    assert not kv.allocate(b, 8, hits)
    assert kv.num_free_blocks == 3 and kv.block_ids(b) == []
    assert all(h.ref_cnt == 0 for h in hits)


def test_shared_prefix_blocks_are_shared_not_copied():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = req(list(range(12)), "a")
    assert kv.allocate(a, 12)
    b = req(list(range(8)) + [7, 7, 7], "b")
    hits = kv.find_cached_prefix(b)
    assert [h.block_id for h in hits] == kv.block_ids(a)[:2]
    assert kv.allocate(b, 3, hits)
    b.num_computed_tokens = 8
    assert kv.num_free_blocks == 6 - 3 - 1
    kv.free(a)
    assert kv.num_free_blocks == 6 - 3  # b still holds the 2 shared blocks + its own
    kv.free(b)
    assert kv.num_free_blocks == 6


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    a = req(list(range(12)), "a")
    assert kv.allocate(a, 12)
    kv.free(a)
    assert kv.find_cached_prefix(req(list(range(12)), "b")) == []
