"""Both pool backends move real paged-cache blocks: the in-process dict, and Mooncake
Store against a real ``mooncake_master`` started on free loopback ports."""

from __future__ import annotations

import time

import pytest
import torch

from pdmesh.shared.infra.net import free_port
from pdmesh.shared.kvpool import CacheRegions, InProcessPool, KVPool
from pdmesh.shared.kvpool.master import MasterSupervisor
from pdmesh.shared.kvpool.mooncake import MooncakePool
from tests.processes import alive


def caches(seed: int | None, layers: int = 3, blocks: int = 6):
    """Per layer (k, v) [blocks, 4, 2, 8]; random if seeded, else zeros."""
    shape = (blocks, 4, 2, 8)
    if seed is None:
        return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(layers)]
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
            for _ in range(layers)]


def round_trip(src_pool: KVPool, dst_pool: KVPool) -> None:
    src, dst = caches(1), caches(None)
    src_regions, dst_regions = CacheRegions(src), CacheRegions(dst)
    for pool, kv in ((src_pool, src), (dst_pool, dst)):
        for k, v in kv:
            pool.register(k)
            pool.register(v)
    keys = ["fp/aa", "fp/bb", "fp/cc"]
    assert src_pool.put(keys, [src_regions.regions(b) for b in (1, 4, 2)]) == [True] * 3
    assert dst_pool.exists(keys + ["fp/missing"]) == [True, True, True, False]
    assert dst_pool.prefix_hits(["fp/aa", "fp/bb", "fp/zz", "fp/cc"]) == 2
    # into other block ids on the other side
    assert dst_pool.get(keys, [dst_regions.regions(b) for b in (5, 0, 3)]) == [True] * 3
    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        for s_b, d_b in ((1, 5), (4, 0), (2, 3)):
            assert torch.equal(sk[s_b], dk[d_b]) and torch.equal(sv[s_b], dv[d_b])
        assert torch.count_nonzero(dk[1]) == 0  # untouched blocks stay untouched
    assert dst_pool.get(["fp/missing"], [dst_regions.regions(1)]) == [False]
    assert torch.count_nonzero(dst[0][0][1]) == 0


def test_in_process_pool():
    pool = InProcessPool()
    round_trip(pool, pool)
    s = pool.stats()
    assert s.keys == 3 and s.bytes == 3 * CacheRegions(caches(1)).value_bytes
    assert s.hits > 0 and s.misses > 0
    assert pool.clear() == 3 and pool.exists(["fp/aa"]) == [False]


def test_in_process_pool_capacity():
    pool = InProcessPool(capacity_bytes=CacheRegions(caches(1)).value_bytes)
    src = CacheRegions(caches(1))
    assert pool.put(["a", "b"], [src.regions(0), src.regions(1)]) == [True, False]


def pool_for(sup: MasterSupervisor) -> MooncakePool:
    return MooncakePool(sup.ports.master_address, sup.ports.metadata_url,
                        segment_bytes=32 << 20, local_buffer_bytes=16 << 20)


def test_mooncake_pool_between_two_clients(mooncake_master):
    master = mooncake_master
    producer, consumer = pool_for(mooncake_master), pool_for(mooncake_master)
    try:
        round_trip(producer, consumer)
        gauges = master.metrics()
        assert gauges["master_key_count"] >= 3
        assert gauges["master_allocated_bytes"] >= 3 * CacheRegions(caches(1)).value_bytes
    finally:
        consumer.close()
        producer.close()


def test_master_restarts_after_being_killed(mooncake_master):
    master = mooncake_master
    import os
    import signal

    before = master.restarts
    os.kill(master.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while master.restarts == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert master.restarts == before + 1
    master.wait_ready(15)
    fresh = pool_for(mooncake_master)  # the restarted master serves new clients
    try:
        src = CacheRegions(caches(2))
        fresh.register(src.tensors[0])
        assert fresh.put(["after/restart"], [src.regions(1)]) == [True]
        assert fresh.exists(["after/restart"]) == [True]
    finally:
        fresh.close()


def test_unreachable_master_is_a_clear_error():
    from pdmesh.shared.kvpool.mooncake import PoolUnavailable

    port = free_port()
    with pytest.raises(PoolUnavailable, match=f"127.0.0.1:{port}"):
        MooncakePool(f"127.0.0.1:{port}", f"http://127.0.0.1:{free_port()}/metadata",
                     segment_bytes=16 << 20, local_buffer_bytes=16 << 20)


def test_full_pool_evicts_old_blocks_instead_of_refusing_puts(tmp_path):
    """Every block is read right after it is written, as decode does. With pdmesh's short
    lease the master evicts the oldest blocks once its memory is full and keeps taking
    puts; with Mooncake's default 10 s lease the same traffic gets puts refused."""
    from pdmesh.shared.kvpool.master import EvictionPolicy, MasterPorts

    def fill(policy: EvictionPolicy, n: int = 200, check_reads: bool = True
             ) -> tuple[int, list[bool], list[bool]]:
        sup = MasterSupervisor(MasterPorts("127.0.0.1", 0, 0, 0),
                               log_path=str(tmp_path / "master.log"), eviction=policy)
        sup.start()
        ports = sup.ports
        pool = MooncakePool(ports.master_address, ports.metadata_url,
                            segment_bytes=16 << 20, local_buffer_bytes=16 << 20)
        try:
            kv = [(torch.randn(4, 256, 64), torch.randn(4, 256, 64))]  # 128 KB blocks
            regions = CacheRegions(kv)
            for t in regions.tensors:
                pool.register(t)
            stored = 0
            for i in range(n):  # 25 MB through a 16 MB segment
                ok = pool.put([f"k{i}"], [regions.regions(i % 4)])[0]
                stored += ok
                # decode's read: the block arrives whole exactly when it was stored
                got = pool.get([f"k{i}"], [regions.regions((i + 1) % 4)])
                assert got == [ok] or not check_reads
                time.sleep(0.005)
            return (stored, pool.exists([f"k{i}" for i in range(5)]),
                    pool.exists([f"k{i}" for i in range(n - 5, n)]))
        finally:
            pool.close()
            sup.stop()

    stored, oldest, newest = fill(EvictionPolicy(lease_ttl_ms=100))
    assert stored == 200 and newest == [True] * 5 and oldest == [False] * 5
    # (with the long lease the master's background eviction may take a block between
    # its put and its first read - seen once in a full suite run - so only the outcome
    # is checked there: puts refused, the oldest blocks pinned)
    stored, oldest, newest = fill(EvictionPolicy(lease_ttl_ms=10_000), check_reads=False)
    assert stored < 200 and oldest == [True] * 5  # what pdmesh's default avoids


def test_eviction_policy_is_validated():
    from pdmesh.shared.kvpool.master import EvictionPolicy

    with pytest.raises(ValueError, match="--kv-lease-ttl-ms"):
        EvictionPolicy(lease_ttl_ms=0)
    with pytest.raises(ValueError, match="--eviction-high-watermark-ratio"):
        EvictionPolicy(high_watermark_ratio=1.5)
    with pytest.raises(ValueError, match="--eviction-ratio"):
        EvictionPolicy(eviction_ratio=0)


def test_master_dies_with_a_supervisor_that_was_killed(tmp_path):
    """A kvstore that is SIGKILLed (no chance to stop its child) leaves no master behind."""
    import os
    import subprocess
    import sys

    script = ("import sys; from pdmesh.shared.kvpool.master import *\n"
              "s = MasterSupervisor(MasterPorts('127.0.0.1', 0, 0, 0)); s.start(); "
              "print(s.pid, flush=True); sys.stdin.read()")
    sup = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        master_pid = int(sup.stdout.readline())
        os.kill(master_pid, 0)  # running
        sup.kill()
        sup.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and alive(master_pid):
            time.sleep(0.05)
        assert not alive(master_pid), f"mooncake_master {master_pid} outlived its supervisor"
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()


def test_a_chosen_port_taken_before_the_master_binds_it_is_chosen_again(tmp_path,
                                                                        monkeypatch):
    """Between choosing a free port and the master binding it another process can take
    it: the master exits at start and the supervisor starts it on fresh ports. A port
    given (not chosen) that is taken fails the start with the master's exit."""
    import socket

    from pdmesh.shared.kvpool import master
    from pdmesh.shared.kvpool.master import MasterExited, MasterPorts

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy])
        monkeypatch.setattr(master, "free_port", lambda host: next(picks, None) or free_port())
        sup = MasterSupervisor(MasterPorts("127.0.0.1", 0, 0, 0),
                               log_path=str(tmp_path / "chosen.log"))
        sup.start()
        try:
            assert sup.ports.rpc != busy and sup.ports.rpc > 0
            pool = MooncakePool(sup.ports.master_address, sup.ports.metadata_url,
                                segment_bytes=16 << 20, local_buffer_bytes=16 << 20)
            try:
                round_trip(pool, pool)
            finally:
                pool.close()
        finally:
            sup.stop()
        given = MasterSupervisor(MasterPorts("127.0.0.1", busy, free_port(), free_port()),
                                 log_path=str(tmp_path / "given.log"))
        with pytest.raises(MasterExited, match="exited with"):
            given.start()
        given.stop()


def test_following_pool_moves_to_a_master_that_came_back_elsewhere(tmp_path):
    """The master goes away and a new one starts on other ports: calls fail fast while
    it is away, then the pool joins the new master, registers the cache memory there,
    and a block it puts is read by another client of the new master."""
    from pdmesh.shared.kvpool.following import FollowingPool
    from pdmesh.shared.kvpool.master import MasterPorts
    from pdmesh.shared.kvpool.mooncake import PoolUnavailable

    def start(name: str) -> MasterSupervisor:
        sup = MasterSupervisor(MasterPorts("127.0.0.1", 0, 0, 0),
                               log_path=str(tmp_path / name))
        sup.start()
        return sup

    def connect(master: tuple[str, str]) -> MooncakePool:
        return MooncakePool(*master, segment_bytes=32 << 20, local_buffer_bytes=16 << 20)

    first = start("a.log")
    where: list[tuple[str, str] | None] = [(first.ports.master_address,
                                            first.ports.metadata_url)]
    pool = FollowingPool(connect(where[0]), connect, lambda: where[0], interval_s=0.2)
    second = reader = None
    try:
        src = CacheRegions(caches(3))
        for t in src.tensors:
            pool.register(t)
        assert pool.put(["before"], [src.regions(0)]) == [True]
        assert not pool.follow()  # its master answers: nothing to do
        assert pool.exists(["before"]) == [True]
        hits_before = pool.stats().hits
        assert hits_before >= 1
        first.stop()
        where[0] = None  # nobody knows yet
        time.sleep(0.6)
        t0 = time.monotonic()
        with pytest.raises(PoolUnavailable):
            pool.exists(["before"])
        assert time.monotonic() - t0 < 2  # fails fast: the engine recomputes
        second = start("b.log")
        where[0] = (second.ports.master_address, second.ports.metadata_url)
        deadline = time.monotonic() + 20
        while pool.moves == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.moves == 1 and pool.master_address == second.ports.master_address
        assert pool.put(["after"], [src.regions(2)]) == [True]
        assert pool.stats().hits >= hits_before  # counters never go back
        reader = connect(where[0])
        dst = CacheRegions(caches(None))
        for t in dst.tensors:
            reader.register(t)
        assert reader.exists(["before", "after"]) == [False, True]
        assert reader.get(["after"], [dst.regions(5)]) == [True]
        for s, d in zip(src.tensors, dst.tensors, strict=True):
            assert torch.equal(s[2], d[5])
    finally:
        if reader is not None:
            reader.close()
        pool.close()
        for sup in (first, second):
            if sup is not None:
                sup.stop()


def test_many_large_reads_at_once_all_arrive(mooncake_master):
    """Eight reads of 1,024 blocks each at once (eight long prompts admitted together):
    every block arrives. In one native call each, Mooncake's TCP transport refused some
    ("TCP lane queue-full rejection") and the prompts were computed again."""
    import threading

    n, nbytes, readers = 1024, 32 << 10, 8
    writer = MooncakePool(mooncake_master.ports.master_address,
                          mooncake_master.ports.metadata_url, segment_bytes=64 << 20,
                          local_buffer_bytes=16 << 20)
    reader = pool_for(mooncake_master)
    try:
        src = torch.randn(n * nbytes // 4)
        dst = [torch.zeros_like(src) for _ in range(readers)]
        writer.register(src)
        for d in dst:
            reader.register(d)
        keys = [f"many/{i}" for i in range(n)]
        assert all(writer.put(keys, [[(src.data_ptr() + i * nbytes, nbytes)]
                                     for i in range(n)]))
        found: list[list[bool]] = [[] for _ in range(readers)]

        def read(j: int) -> None:
            found[j] = reader.get(keys, [[(dst[j].data_ptr() + i * nbytes, nbytes)]
                                         for i in range(n)])

        threads = [threading.Thread(target=read, args=(j,)) for j in range(readers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [sum(f) for f in found] == [n] * readers
        assert all(torch.equal(d, src) for d in dst)
    finally:
        reader.close()
        writer.close()
