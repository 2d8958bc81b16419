"""KV tiers under the prefix cache (engine/kv_tiers.py, tier_connector.py, kvpool/file.py):
a prefix evicted from the engine's blocks is read back from host memory or from the file
store, the outputs token-identical to an engine that computed it; a damaged file is a
miss, never a block served."""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch

from pdmesh.shared.engine import LLM, EngineConfig, EngineCore, SamplingParams, build_engine
from pdmesh.shared.engine.kv_tiers import HostTier, TierConfig
from pdmesh.shared.kvpool.file import HEADER, FilePool

NEW = 8
_g = torch.Generator().manual_seed(45)
# A, then four others that push A's blocks out of a 16-block L1, then A again
A = torch.randint(10, 4000, (70,), generator=_g).tolist()
OTHERS = [torch.randint(10, 4000, (70,), generator=_g).tolist() for _ in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def tiered(path, tiers: TierConfig, **extra) -> EngineCore:
    return build_engine(EngineConfig(model=str(path), device="cpu", dtype="float32",
                                     block_size=16, num_kv_blocks=16, kv_tiers=tiers,
                                     **extra))


def run_one(eng: EngineCore, prompt: list[int]):
    req = eng.add_request(prompt, GREEDY)
    while eng.has_unfinished():
        eng.step()
    return req


def expected_for(path, prompts, **extra) -> list[list[int]]:
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16, **extra)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def expected(qwen3_path):
    return expected_for(qwen3_path, [A])[0]


@pytest.mark.parametrize("policy,warm", [("write_through", 1), ("write_back", 1),
                                         ("write_through_selective", 3)])
def test_a_prefix_evicted_from_the_device_comes_back_from_host_memory(qwen3_path, expected,
                                                                      policy, warm):
    eng = tiered(qwen3_path, TierConfig(host_bytes=64 << 20, write_policy=policy))
    tier = eng.connector.tier
    for _ in range(warm):
        run_one(eng, A)
    for p in OTHERS:
        run_one(eng, p)
    hits_before = tier.stats.hits["host"]
    again = run_one(eng, A)
    assert again.output_token_ids == expected
    # its 4 full prompt blocks came from L2 (70 tokens: the last one is computed)
    assert again.num_cached_tokens == 64
    assert tier.stats.hits["host"] - hits_before == 4
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_selective_writes_only_blocks_hit_twice(qwen3_path, expected):
    eng = tiered(qwen3_path, TierConfig(host_bytes=64 << 20,
                                        write_policy="write_through_selective"))
    run_one(eng, A)
    run_one(eng, A)  # one hit: not copied yet
    assert eng.connector.tier.occupancy() == [0]
    run_one(eng, A)  # the second hit
    assert eng.connector.tier.occupancy() == [4]


@pytest.mark.parametrize("load_async", [True, False])
def test_the_file_tier_serves_a_prefix_after_a_restart(qwen3_path, expected, tmp_path,
                                                       load_async):
    """Read beside the steps (the default) or inside the step that admits it
    (vLLM-Ascend's load_async false)."""
    tiers = TierConfig(host_bytes=64 << 20, storage="file", storage_dir=str(tmp_path))
    first = tiered(qwen3_path, tiers)
    run_one(first, A)
    first.close()  # (its storage writes done)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == 4  # A's full blocks (70 + 8 tokens: 4 x 16, and a partial one)
    # a new process's engine: L1 and L2 empty
    second = tiered(qwen3_path, tiers, kv_load_async=load_async)
    assert second.scheduler.async_kv_load is load_async
    again = run_one(second, A)
    assert again.output_token_ids == expected
    assert again.num_cached_tokens == 64
    assert second.connector.tier.stats.hits["storage"] == 4


def test_the_mooncake_store_serves_a_prefix_to_the_next_engine(qwen3_path, expected,
                                                               mooncake_master, caplog):
    """--hicache-storage-backend mooncake: the blocks host memory takes go on to a real
    Mooncake pool, where an engine with empty L1 and L2 (another instance, a restart)
    reads them back; with the master gone, the prompt is computed (the last test of
    the module's master)."""
    from pdmesh.shared.kvpool.mooncake import MooncakePool

    pools = [MooncakePool(mooncake_master.ports.master_address,
                          mooncake_master.ports.metadata_url, segment_bytes=32 << 20,
                          local_buffer_bytes=16 << 20) for _ in range(2)]
    tiers = TierConfig(host_bytes=64 << 20, storage="mooncake")
    config = EngineConfig(model=str(qwen3_path), device="cpu", dtype="float32", block_size=16,
                          num_kv_blocks=16, kv_tiers=tiers)
    try:
        first = build_engine(config, kv_pool=pools[0])
        run_one(first, A)
        first.close()  # (its storage writes done)
        second = build_engine(config, kv_pool=pools[1])
        again = run_one(second, A)
        assert again.output_token_ids == expected
        assert again.num_cached_tokens == 64
        assert second.connector.tier.stats.hits["storage"] == 4
        second.close()
        third = build_engine(config, kv_pool=pools[0])  # (it registers its cache: first)
        mooncake_master.stop()
        with caplog.at_level(logging.WARNING):
            gone = run_one(third, A)
        assert gone.output_token_ids == expected and gone.num_cached_tokens == 0
        assert "is down" in caplog.text
        third.close()
    finally:
        for pool in pools:
            pool.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_damaged_file_is_recomputed_never_served(qwen3_path, expected, tmp_path, damage,
                                                   caplog):
    tiers = TierConfig(host_bytes=64 << 20, storage="file", storage_dir=str(tmp_path))
    first = tiered(qwen3_path, tiers)
    req = run_one(first, A)
    key = first.connector.key(0, req.block_hashes[1])  # A's second block
    block_bytes = first.connector.tier.stores[0].block_bytes
    first.close()
    path = first.connector.tier.storage.path(key)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[HEADER.size + 100] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:len(data) // 2]))
    else:
        path.unlink()
    second = tiered(qwen3_path, tiers)
    with caplog.at_level(logging.WARNING):
        again = run_one(second, A)
    assert again.output_token_ids == expected
    store = second.connector.tier.storage
    # A's first block is read; from the damaged one on the prompt is computed (removed:
    # the tiers never offer it; damaged: found so as it is read, and the read stops there)
    assert again.num_cached_tokens == 16
    if damage != "remove":
        assert store.corrupt == 1 and "truncated or altered" in caplog.text
        assert "1 of 4 blocks missing from the KV tiers; computing from block 1" in caplog.text
    second.close()  # computed again, the block is stored again, whole
    buf, regions = _buffer(block_bytes, 0)
    assert FilePool(tmp_path).get([key], [regions]) == [True]


@pytest.mark.parametrize("load_async", [True, False])
def test_a_failed_read_fails_the_request_under_the_fail_policy(qwen3_path, expected, tmp_path,
                                                               load_async):
    """vLLM's kv_load_failure_policy "fail": a damaged block ends its request with an
    error (reported once, its blocks back) instead of a recompute; the engine goes on."""
    from pdmesh.shared.engine.request import RequestStatus

    tiers = TierConfig(host_bytes=64 << 20, storage="file", storage_dir=str(tmp_path))
    first = tiered(qwen3_path, tiers)
    req = run_one(first, A)
    key = first.connector.key(0, req.block_hashes[1])
    first.close()
    path = first.connector.tier.storage.path(key)
    data = bytearray(path.read_bytes())
    data[HEADER.size + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    second = tiered(qwen3_path, tiers, kv_load_failure_policy="fail", kv_load_async=load_async)
    failed = second.add_request(A, GREEDY)
    outputs = []
    while second.has_unfinished():
        outputs += second.step()
    assert failed.status is RequestStatus.FINISHED_ERROR and failed.output_token_ids == []
    assert [o.finished for o in outputs if o.request is failed] == [True]
    assert second.scheduler.load_failures == 1
    assert second.kv.num_free_blocks == second.kv.num_blocks
    again = run_one(second, A)  # (the damaged file is gone: its first block read, the
    assert again.output_token_ids == expected  # rest computed)
    assert again.num_cached_tokens == 16


def _buffer(n: int, fill: int) -> tuple[ctypes.Array, list[tuple[int, int]]]:
    buf = (ctypes.c_char * n)(*([fill] * n))
    return buf, [(ctypes.addressof(buf), n // 2), (ctypes.addressof(buf) + n // 2, n - n // 2)]


def test_file_pool_round_trip_full_and_failing_disk(tmp_path, caplog):
    pool = FilePool(tmp_path / "store", capacity_bytes=300)
    src, regions = _buffer(128, 7)
    dst, out = _buffer(128, 0)
    assert pool.put(["fp/aa", "fp/bb/window"], [regions, regions]) == [True, True]
    assert pool.exists(["fp/aa", "fp/bb/window", "fp/cc"]) == [True, True, False]
    assert pool.get(["fp/bb/window"], [out]) == [True]
    assert bytes(dst) == bytes(src)
    with caplog.at_level(logging.WARNING):  # 256 of 300 bytes used: the next is refused
        assert pool.put(["fp/dd"], [regions]) == [False]
    assert "are used" in caplog.text
    broken = FilePool(tmp_path / "broken")
    (tmp_path / "broken").rmdir()
    (tmp_path / "broken").write_text("not a directory")  # every write fails now
    with caplog.at_level(logging.WARNING):
        assert broken.put(["fp/aa"], [regions]) == [False]
    assert broken.write_failures == 1 and "a write failed" in caplog.text
    with pytest.raises(ValueError, match="not a pool key"):
        pool.path("fp/")


def test_host_tier_keeps_the_most_recent_blocks_within_its_size():
    cache = torch.arange(10 * 4, dtype=torch.float32).view(10, 4)
    tier = HostTier([[cache]], capacity_bytes=3 * 16)  # three 16-byte blocks
    assert tier.capacity_blocks == [3]
    assert tier.put(["k1", "k2", "k3"], [(0, 1), (0, 2), (0, 3)]) == 3
    tier.get(["k1"], [(0, 9)])  # k1 used: k2 is now the least recent
    tier.put(["k4"], [(0, 4)])
    assert tier.holds(["k1", "k2", "k3", "k4"], [0] * 4) == [True, False, True, True]
    assert torch.equal(cache[9], cache[1])
    got = tier.get(["k4", "k2"], [(0, 0), (0, 5)])
    assert got == [True, False]
    assert torch.equal(cache[0], cache[4]) and cache[5].tolist() == [20, 21, 22, 23]
    with pytest.raises(ValueError, match="--hicache-size"):
        HostTier([[cache]], capacity_bytes=8)


def test_tier_flags_are_checked_by_name():
    for bad, match in ((TierConfig(write_policy="write_around"), "--hicache-write-policy"),
                       (TierConfig(storage="hf3fs"), "--hicache-storage-backend"),
                       (TierConfig(host_ratio=0), "--hicache-ratio"),
                       (TierConfig(prefetch_policy="eager"),
                        "--hicache-storage-prefetch-policy")):
        with pytest.raises(ValueError, match=match):
            bad.validate()


@pytest.mark.parametrize("arch,extra", [("llama", {}), ("qwen3_moe", {}), ("deepseek_v3", {}),
                                        ("deepseek_v4", {}),
                                        ("qwen3", {"kv_cache_dtype": "int8"})])
def test_every_architecture_reads_back_token_identical(tiny_models, arch, extra):
    """MLA's latent, DeepSeek-V4's compressed and sliding groups, the int8 cache and its
    scales: each goes down to host memory and comes back as it was."""
    path = tiny_models[arch]
    want = expected_for(path, [A], **extra)[0]
    eng = tiered(path, TierConfig(host_bytes=64 << 20), **extra)
    run_one(eng, A)
    for p in OTHERS:
        run_one(eng, p)
    again = run_one(eng, A)
    assert again.output_token_ids == want
    assert again.num_cached_tokens == 64
    assert eng.connector.tier.stats.hits["host"] >= 4


def test_a_block_read_and_written_at_once_keeps_one_slot():
    """A storage read of a key that a write puts in L2 meanwhile (two requests on one
    prefix): one slot keeps the key, the other goes back; none is lost."""
    from pdmesh.shared.kvpool import InProcessPool

    cache = torch.arange(10 * 4, dtype=torch.float32).view(10, 4)
    store = InProcessPool()
    src = torch.full((4,), 7.0)
    store.put(["k"], [[(src.data_ptr(), 16)]])
    tier = HostTier([[cache]], capacity_bytes=3 * 16, storage=store)

    class Racing(InProcessPool):
        def get(self, keys, regions):
            tier.put(["k"], [(0, 2)])  # the write, while the read runs
            return store.get(keys, regions)

        def exists(self, keys):
            return store.exists(keys)

    tier.storage = Racing()
    assert tier.get(["k"], [(0, 9)]) == [True]
    assert cache[9].tolist() == [7.0] * 4  # what the read brought
    tier.flush()
    s = tier.stores[0]
    assert len(s.slot_of) == 1 and sorted(s.free + list(s.slot_of.values())) == [0, 1, 2]
