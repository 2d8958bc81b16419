"""`pdmesh status` against a real redis, a real kvstore and a real EPLB controller."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch

from pdmesh.cli import parse_args
from pdmesh.shared.cli.status import run
from pdmesh.shared.infra.launcher import Service
from pdmesh.shared.infra.registry import Instance, Registry
from pdmesh.shared.kvpool import CacheRegions
from pdmesh.shared.kvpool.mooncake import MooncakePool
from pdmesh.shared.proto import eplb_pb2, eplb_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc

REDIS = "redis://127.0.0.1:6379/0"
GROUP = "decode@127.0.0.1:45999"  # the DP rpc port is made up: only the name matters


def status(prefix: str, *extra: str, capsys) -> tuple[int, str]:
    args = parse_args(["status", "--registry-prefix", prefix, *extra])[2]
    rc = run(args)
    return rc, capsys.readouterr().out


def put_mesh(prefix: str) -> None:
    """Two decode DP ranks of one group and a draining prefill instance."""
    reg = Registry(REDIS, prefix, ttl_s=60)
    reg.put(Instance("decode-r0", "decode", "127.0.0.1:50301", "tiny", dp_size=2, dp_rank=0,
                     load={"running": 3, "waiting": 1, "free_kv_blocks": 25,
                           "total_kv_blocks": 100, "placement_version": 2,
                           "spec_draft_tokens": 40, "spec_accepted_tokens": 10}))
    reg.put(Instance("decode-r1", "decode", "127.0.0.1:50302", "tiny", dp_size=2, dp_rank=1,
                     load={"running": 4, "waiting": 0, "free_kv_blocks": 100,
                           "total_kv_blocks": 100, "placement_version": 2}))
    reg.put(Instance("prefill-a", "prefill", "127.0.0.1:50200", "tiny", draining=True,
                     load={"running": 0, "waiting": 5, "free_kv_blocks": 10,
                           "total_kv_blocks": 40}, adapters=("sql", "old")))
    reg.put_adapter("sql", "/adapters/sql")
    reg.put_adapter("chat", "/adapters/chat")


def row(out: str, first: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.split()[:1] == [first]
                or line.split()[1:2] == [first])


def test_registered_instances_in_table_and_json(registry_prefix, capsys):
    prefix = f"{registry_prefix}:table"
    put_mesh(prefix)
    rc, out = status(prefix, capsys=capsys)
    assert rc == 0
    assert "3 live" in out
    # ROLE ID ADDRESS MODEL DP RUN WAIT KV% SPEC-ACC% PLACEMENT HEARTBEAT(2 words)
    # DRAINING (empty cells vanish when split)
    r0 = row(out, "decode-r0")
    assert r0[:10] == ["decode", "decode-r0", "127.0.0.1:50301", "tiny", "0/2", "3", "1",
                       "75.0", "25.0", "v2"]
    assert float(r0[10].removesuffix("s")) < 10 and r0[11:] == ["ago"]
    assert row(out, "decode-r1")[4:9] == ["1/2", "4", "0", "0.0", "v2"]
    pf = row(out, "prefill-a")
    assert pf[4:8] == ["0/1", "0", "5", "75.0"] and pf[-1] == "yes"
    assert "no kvstore registered" in out and "no controller registered" in out
    # the DP group is derived from the registry; without a controller only the ranks show
    assert row(out, "decode@127.0.0.1")[1:5] == ["tiny", "2/2", "v2", "-"]
    # the LoRA adapters served, and who holds each (one held but no longer served too)
    assert "LORA ADAPTERS" in out
    assert row(out, "sql") == ["sql", "/adapters/sql", "prefill-a"]
    assert row(out, "chat") == ["chat", "/adapters/chat", "-"]
    assert row(out, "old") == ["old", "(not", "served)", "prefill-a"]

    rc, out = status(prefix, "--json", capsys=capsys)
    data = json.loads(out)
    assert rc == 0 and data["prefix"] == prefix and data["pools"] == []
    by_id = {i["id"]: i for i in data["instances"]}
    assert set(by_id) == {"decode-r0", "decode-r1", "prefill-a"}
    assert by_id["decode-r0"] | {"heartbeat_age_s": 0} == {
        "role": "decode", "id": "decode-r0", "address": "127.0.0.1:50301", "model": "tiny",
        "dp_rank": 0, "dp_size": 2, "running": 3, "waiting": 1, "kv_cache_usage_perc": 0.75,
        "placement_version": 2, "heartbeat_age_s": 0, "draining": False,
        "spec_acceptance": 0.25, "lora_adapters": [], "kv_tiers": None}
    assert by_id["decode-r1"]["spec_acceptance"] is None
    assert 0 <= by_id["decode-r0"]["heartbeat_age_s"] < 10
    assert by_id["prefill-a"]["draining"] and by_id["prefill-a"]["placement_version"] == 0
    assert data["eplb_controller"] is None
    assert data["lora_adapters"] == {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    assert by_id["prefill-a"]["lora_adapters"] == ["sql", "old"]
    [group] = data["eplb_groups"]
    assert (group["role"], group["dp_size"], group["ranks"], group["rank_versions"]) == \
        ("decode", 2, [0, 1], [2])


def test_unreachable_pool_and_controller(registry_prefix, capsys):
    prefix = f"{registry_prefix}:dead"
    reg = Registry(REDIS, prefix, ttl_s=60)
    reg.put(Instance("kvstore-dead", "kvstore", "127.0.0.1:1"))
    reg.put(Instance("eplb-dead", "eplb", "127.0.0.1:1"))
    t0 = time.monotonic()
    rc, out = status(prefix, "--eplb-group", GROUP, "--rpc-timeout", "0.5", capsys=capsys)
    assert rc == 0 and time.monotonic() - t0 < 5
    assert "kvstore-dead at 127.0.0.1:1: unreachable" in out
    assert "controller eplb-dead at 127.0.0.1:1" in out
    assert "unreachable (" in " ".join(row(out, GROUP))


@pytest.fixture(scope="module")
def live_mesh(tmp_path_factory, registry_prefix):
    """A real kvstore and EPLB controller registered under their own prefix."""
    prefix = f"{registry_prefix}:live"
    logs = tmp_path_factory.mktemp("status")
    kv = Service("kvstore", ["kvstore", "--registry-prefix", prefix], logs, timeout_s=30)
    try:
        eplb = Service("eplb", ["eplb", "--registry-prefix", prefix, "--metrics-port", "-1",
                                "--interval-s", "3600"], logs, timeout_s=30)
        try:
            yield prefix, kv.info, eplb.address
        finally:
            eplb.stop()
    finally:
        kv.stop()


def test_pool_and_eplb_numbers_from_live_services(live_mesh, capsys, request):
    prefix, kv, eplb_address = live_mesh
    kv_address = kv["grpc"]
    pool = MooncakePool(kv["master"], kv["metadata"], segment_bytes=32 << 20,
                        local_buffer_bytes=16 << 20)
    request.addfinalizer(pool.close)  # the blocks live in its segment until then
    regions = CacheRegions([(torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8))])
    for t in regions.tensors:
        pool.register(t)
    assert pool.put(["m/1", "m/2"], [regions.regions(0), regions.regions(1)]) == [True] * 2
    with grpc.insecure_channel(kv_address) as ch:  # 2 hits, 1 miss
        kvstore_pb2_grpc.KVStoreStub(ch).Lookup(
            kvstore_pb2.LookupRequest(keys=["m/1", "m/2", "m/3"]), timeout=5)
    with grpc.insecure_channel(eplb_address) as ch:
        stub = eplb_pb2_grpc.EplbStub(ch)
        for rank in (0, 1):  # 1 layer, 2 experts, 2 ranks: loads 30 and 10 whatever the
            stub.ReportLoad(eplb_pb2.LoadReport(  # placement, balancedness 20/30
                group=GROUP, dp_rank=rank, dp_size=2, num_layers=1, num_experts=2,
                num_slots=2, counts=[15, 5], step=1), timeout=5)
        assert stub.Rebalance(eplb_pb2.RebalanceRequest(group=GROUP, force=True),
                              timeout=10).version == 1
    put_mesh(prefix)

    rc, out = status(prefix, "--eplb-group", GROUP, capsys=capsys)
    assert rc == 0
    assert f"at {kv_address}: 2 keys, " in out
    assert ", 2 hits, 1 misses, hit rate 66.7%" in out
    assert f"at {eplb_address}" in out
    # GROUP MODEL RANKS RANKS-RUN VERSION BALANCEDNESS: matched to the registry's ranks
    assert row(out, GROUP)[1:] == ["tiny", "2/2", "v2", "1", "0.667"]

    rc, out = status(prefix, "--eplb-group", GROUP, "--json", capsys=capsys)
    data = json.loads(out)
    [pool] = data["pools"]
    assert (pool["address"], pool["reachable"], pool["keys"], pool["hits"],
            pool["misses"]) == (kv_address, True, 2, 2, 1)
    assert pool["hit_rate"] == pytest.approx(2 / 3)
    assert pool["bytes"] >= 2 * regions.value_bytes
    [group] = data["eplb_groups"]
    assert (group["group"], group["version"], group["reports"], group["ranks"]) == \
        (GROUP, 1, 2, [0, 1])
    assert group["mean_balancedness"] == pytest.approx(20 / 30)


def test_empty_registry(registry_prefix, capsys):
    prefix = f"{registry_prefix}:empty"
    assert status(prefix, capsys=capsys) == (0, f"no instances registered under prefix "
                                                f"{prefix}\n")


def test_redis_down_is_one_line_and_exit_2():
    url = "redis://127.0.0.1:1/0"
    r = subprocess.run([sys.executable, "-m", "pdmesh", "status", "--redis-url", url],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and url in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_watch_interval_is_an_error(registry_prefix):
    args = parse_args(["status", "--watch", "0"])[2]
    with pytest.raises(ValueError, match="--watch"):
        run(args)


def test_does_not_import_torch(registry_prefix):
    code = ("import json, sys\n"
            "from pdmesh.cli import main\n"
            f"assert main(['status', '--json', '--registry-prefix', '{registry_prefix}:none'])"
            " == 0\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["instances"] == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_watch_redraws_until_ctrl_c(registry_prefix, tmp_path, sig):
    """Redrawn until Ctrl-C (or SIGTERM), which ends it between two snapshots, rc 0.
    (Its output goes to a file: a pipe nobody reads would fill and hold it.)"""
    prefix = f"{registry_prefix}:watch"
    put_mesh(prefix)
    out = tmp_path / "watch.out"
    with open(out, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "pdmesh", "status", "--json",
                                 "--watch", "0.2", "--registry-prefix", prefix],
                                stdout=sink, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while out.read_text().count("\n") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        snapshots = [json.loads(line) for line in out.read_text().splitlines()[:2]]
        assert [len(s["instances"]) for s in snapshots] == [3, 3]
        assert snapshots[1]["time"] > snapshots[0]["time"]
    finally:
        proc.send_signal(sig)
        rc = proc.wait(15)
    assert rc == 0 and "Traceback" not in proc.stderr.read()


def test_dp_ranks_name_their_eplb_group(registry_prefix):
    """Ranks register their group, so the EPLB section finds it without --eplb-group."""
    from pdmesh.shared.cli.status import collect

    prefix = registry_prefix + ":status-group"
    reg = Registry(REDIS, prefix)
    for rank in (0, 1):
        reg.put(Instance(f"decode-r{rank}", "decode", f"127.0.0.1:{7000 + rank}", "m",
                         dp_size=2, dp_rank=rank, group="decode@127.0.0.1:29500",
                         load={"placement_version": 3}))
    groups = collect(reg, REDIS).eplb_groups
    assert [(g.group, g.ranks, g.rank_versions) for g in groups] == [
        ("decode@127.0.0.1:29500", [0, 1], [3])]
