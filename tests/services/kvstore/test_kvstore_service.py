"""`pdmesh kvstore` as a real process: its Mooncake master, the gRPC index, a restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch

from pdmesh.shared.kvpool import CacheRegions
from pdmesh.shared.kvpool.mooncake import MooncakePool
from pdmesh.shared.proto import common_pb2, kvstore_pb2, kvstore_pb2_grpc


@pytest.fixture(scope="module")
def kvstore(tmp_path_factory, registry_prefix):
    log = tmp_path_factory.mktemp("kvstore") / "master.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdmesh", "kvstore", "--master-log", str(log),
         "--registry-prefix", registry_prefix],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        info = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("kvstore ready: "):
                info = json.loads(line.removeprefix("kvstore ready: "))
                break
            if not line and proc.poll() is not None:
                break
        assert info is not None, "kvstore did not report ready"
        yield proc, info
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the service and its mooncake_master
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def stub(info):
    return kvstore_pb2_grpc.KVStoreStub(grpc.insecure_channel(info["grpc"]))


def test_lookup_stats_clear(kvstore):
    _, info = kvstore
    s = stub(info)
    assert s.Health(common_pb2.HealthRequest(), timeout=5).role == "kvstore"
    pool = MooncakePool(info["master"], info["metadata"], segment_bytes=32 << 20,
                        local_buffer_bytes=16 << 20)
    try:
        kv = [(torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8)) for _ in range(2)]
        regions = CacheRegions(kv)
        for t in regions.tensors:
            pool.register(t)
        assert pool.put(["m/1", "m/2"], [regions.regions(0), regions.regions(1)]) == [True] * 2
        r = s.Lookup(kvstore_pb2.LookupRequest(keys=["m/1", "m/2", "m/3", "m/1"]), timeout=5)
        assert list(r.exists) == [True, True, False, True] and r.prefix_hits == 2
        st = s.Stats(kvstore_pb2.StatsRequest(), timeout=5)
        assert st.keys >= 2 and st.bytes >= 2 * regions.value_bytes
        assert st.hits >= 3 and st.misses >= 1 and st.master_address == info["master"]
        assert s.Clear(kvstore_pb2.ClearRequest(), timeout=5).removed >= 2
        r = s.Lookup(kvstore_pb2.LookupRequest(keys=["m/1"]), timeout=5)
        assert list(r.exists) == [False]
    finally:
        pool.close()


def test_oversized_lookup_is_invalid_argument(kvstore):
    _, info = kvstore
    with pytest.raises(grpc.RpcError) as e:
        stub(info).Lookup(kvstore_pb2.LookupRequest(keys=["k"] * 70000), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "keys" in e.value.details()


def test_the_kvstore_serves_without_torch(kvstore):
    """It indexes and hands out addresses, never tensors; every mesh start pays for its
    imports (torch alone is ~2 s of CPU)."""
    proc, info = kvstore
    assert stub(info).Health(common_pb2.HealthRequest(), timeout=5).role == "kvstore"
    maps = open(f"/proc/{proc.pid}/maps").read()
    assert "libtorch" not in maps


def test_service_restarts_its_master(kvstore):
    _, info = kvstore
    s = stub(info)
    before = s.Stats(kvstore_pb2.StatsRequest(), timeout=5).master_restarts
    os.kill(info["master_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 20
    restarts = before
    while restarts == before and time.monotonic() < deadline:
        time.sleep(0.2)
        restarts = s.Stats(kvstore_pb2.StatsRequest(), timeout=5).master_restarts
    assert restarts == before + 1
