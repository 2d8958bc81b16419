"""Block pool, chained hashing and the KV-cache manager, without a model."""

from __future__ import annotations

import pytest

from pdmesh.shared.engine.block_manager import (
    NULL_BLOCK_ID,
    BlockHasher,
    BlockPool,
    GroupBlocks,
    KVCacheManager,
)
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
    assert kv.find_cached_prefix(a).num_blocks == 0
    assert kv.allocate(a, 9)
    a.num_computed_tokens = 9
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = req(list(range(8)) + [50, 51], "b")
    hits = kv.find_cached_prefix(b)
    assert hits.num_blocks == 2  # a's first two blocks, although a is gone
    # a new request with unrelated tokens takes the LRU free blocks first: a's tail
    # block was freed first (tail-first), then block 1, then block 0
    c = req([70] * 8, "c")
    assert kv.allocate(c, 8)
    assert kv.find_cached_prefix(b).num_blocks == 2  # the prefix blocks survived
    d = req([80] * 4, "d")
    assert kv.allocate(d, 4)  # now a prefix block is evicted
    assert kv.find_cached_prefix(b).num_blocks < 2


def test_whole_prompt_hit_still_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = req(list(range(8)), "a")
    assert kv.allocate(a, 8)
    kv.free(a)
    again = req(list(range(8)), "again")
    assert kv.find_cached_prefix(again).num_blocks == 1  # (8 - 1) // 4 blocks at most


def test_allocate_failure_changes_nothing_and_counts_reclaimed_hits():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    a = req(list(range(8)), "a")
    assert kv.allocate(a, 8)
    kv.free(a)
    b = req(list(range(8)) + list(range(100, 108)), "b")  # 4 blocks, 2 cached
    hits = kv.find_cached_prefix(b)
    assert hits.num_blocks == 2
    # needs 2 more blocks, but only 1 is free once the 2 hits are taken back
    assert not kv.allocate(b, 8, hits)
    assert kv.num_free_blocks == 3 and kv.block_ids(b) == []
    assert all(h.ref_cnt == 0 for h in hits.blocks[0])


def test_shared_prefix_blocks_are_shared_not_copied():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = req(list(range(12)), "a")
    assert kv.allocate(a, 12)
    b = req(list(range(8)) + [7, 7, 7], "b")
    hits = kv.find_cached_prefix(b)
    assert [h.block_id for h in hits.blocks[0]] == kv.block_ids(a)[:2]
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
    assert kv.find_cached_prefix(req(list(range(12)), "b")).num_blocks == 0


# -- several cache groups: a history group and a sliding window group --------------------
def hybrid(history: int = 12, window_blocks: int = 6, window: int = 5,
           caching: bool = True) -> KVCacheManager:
    return KVCacheManager([GroupBlocks("history", history),
                           GroupBlocks("window", window_blocks, window=window)],
                          block_size=4, enable_prefix_caching=caching)


def test_sliding_group_gives_back_what_its_window_left_behind():
    kv = hybrid()
    a = req(list(range(30)), "a")
    assert kv.allocate(a, 12)  # a prefill chunk: tokens 0..11, every block written
    assert len(kv.block_ids(a, 0)) == len(kv.block_ids(a, 1)) == 3
    assert 0 not in kv.block_ids(a, 1)
    a.num_computed_tokens = 12
    assert kv.allocate(a, 8)  # tokens 12..19: the window needs 12 - 5 = 7 on (block 1)
    window = kv.block_ids(a, 1)
    assert window[0] == 0 and 0 not in window[1:] and len(window) == 5
    assert kv.usage()["window"] == (6 - 4, 6)
    assert kv.usage()["history"] == (12 - 5, 12)  # history keeps every block
    a.num_computed_tokens = 20
    assert kv.allocate(a, 1)
    assert kv.block_ids(a, 1)[:3] == [0, 0, 0]  # 20 - 5 = 15: blocks 0..2 gone
    kv.free(a)
    assert kv.usage() == {"history": (12, 12), "window": (6, 6)}


def test_hybrid_allocation_is_all_or_nothing():
    kv = hybrid(history=12, window_blocks=3)
    a = req(list(range(40)), "a")
    assert not kv.allocate(a, 16)  # the window group cannot hold a 16-token chunk
    assert kv.block_ids(a, 0) == [] and kv.usage() == {"history": (12, 12), "window": (3, 3)}
    assert kv.allocate(a, 8)
    b = req(list(range(100, 140)), "b")
    assert not kv.allocate(b, 8)  # window full
    assert kv.usage()["history"] == (10, 12) and kv.block_ids(b, 0) == []


def test_prefix_hit_needs_the_window_blocks_too():
    kv = hybrid(history=12, window_blocks=8)
    a = req(list(range(21)), "a")  # 5 full blocks + 1 token
    assert kv.allocate(a, 12)
    a.num_computed_tokens = 12
    assert kv.allocate(a, 9)  # window blocks 0 and 1 go back to the pool (still cached)
    a.num_computed_tokens = 21
    kv.free(a)
    b = req(list(range(21)) + [99], "b")
    hit = kv.find_cached_prefix(b)
    assert hit.num_blocks == 5  # (22 - 1) // 4: every history block, the window's from 3
    assert hit.blocks[1][:3] == [None] * 3 and all(hit.blocks[1][3:])
    assert all(hit.blocks[0])
    # an unrelated request takes six window blocks, the least recently freed first: the
    # ones the 5-block prefix's window needs (blocks 3, 4) are among them; the history
    # group has free blocks that held nothing, so its cached blocks survive
    d = req([8] * 24, "d")
    assert kv.allocate(d, 24)
    hit = kv.find_cached_prefix(b)
    assert hit.num_blocks == 3  # the longest prefix whose window blocks (1, 2) remain
    assert not kv.allocate(b, 22 - 12, hit)  # 2 window blocks free, 2 hits, 3 more needed
    assert all(x.ref_cnt == 0 for x in hit.blocks[1] if x is not None)
    kv.free(d)
    assert kv.allocate(b, 22 - 12, hit)
    kv.free(b)
    assert kv.usage() == {"history": (12, 12), "window": (8, 8)}


def test_adopting_a_hybrid_prefix_and_freeing_leaks_nothing():
    kv = hybrid(history=12, window_blocks=8)
    a = req(list(range(17)), "a")
    assert kv.allocate(a, 17)
    a.num_computed_tokens = 17
    b = req(list(range(16)) + [50, 51, 52], "b")
    hit = kv.find_cached_prefix(b)
    assert hit.num_blocks == 4
    assert kv.allocate(b, 3, hit)
    b.num_computed_tokens = 16
    assert kv.block_ids(b, 0)[:4] == kv.block_ids(a, 0)[:4]  # shared, not copied
    assert kv.block_ids(b, 1)[:2] == [0, 0]  # before the window: never adopted
    kv.free(a)
    kv.free(b)
    assert kv.usage() == {"history": (12, 12), "window": (8, 8)}
