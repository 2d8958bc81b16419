"""A decode instance of two data-parallel ranks split over two "nodes" as vLLM's
multi-node recipes launch it - node 0 with --data-parallel-size-local 1, node 1 with
--data-parallel-start-rank 1 --headless, both dialling node 0's address and rpc port - on
loopback: each launcher starts only its own rank, and every answer equals the
single-process engine's (what single-node DP answers, tests/services/pd/test_data_parallel.py)."""

from __future__ import annotations

import pytest

from pdmesh.shared.infra.launcher import Service
from pdmesh.shared.infra.net import free_port
from pdmesh.shared.infra.registry import Registry
from tests.mesh import stop_all
from tests.services.pd.test_data_parallel import (
    ENGINE,
    MODEL,
    concurrent_answers,
    offline_answers,
)


@pytest.fixture(scope="module")
def mesh(tiny_models, tmp_path_factory, registry_prefix):
    moe = str(tiny_models["qwen3_moe"])
    logs = tmp_path_factory.mktemp("mn-dp-logs")
    prefix = registry_prefix + "-mndp"
    reg = ["--registry-prefix", prefix]
    dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1",
          "--data-parallel-address", "127.0.0.1",
          "--data-parallel-rpc-port", str(free_port("127.0.0.1")), "--enable-expert-parallel"]
    started: list[Service] = []
    try:
        kv = Service("kvstore", ["kvstore", *reg], logs)
        started.append(kv)
        started.append(Service("prefill", ["prefill", moe, "--kvstore", kv.address,
                                           "--served-model-name", MODEL, *ENGINE, *reg], logs,
                               wait=False))
        decode = ["decode", moe, "--kvstore", kv.address, "--served-model-name", MODEL,
                  *dp, *ENGINE, *reg]
        nodes = [Service("decode", decode, logs, wait=False),
                 Service("decode", [*decode, "--data-parallel-start-rank", "1", "--headless"],
                         logs, wait=False)]
        started += nodes
        for node in started[1:]:  # rank 0 is ready only once rank 1 joined its group
            node.wait_ready()
        gw = Service("gateway", ["gateway", moe, "--port", "0", "--served-model-name", MODEL,
                                 *reg], logs)
        started.append(gw)
        yield {"url": gw.info["http"], "nodes": nodes, "prefix": prefix}
    finally:
        stop_all(started)


def test_each_node_runs_only_its_own_rank(mesh):
    decode = Registry(prefix=mesh["prefix"]).instances("decode")
    assert sorted((i.dp_rank, i.dp_size) for i in decode) == [(0, 2), (1, 2)]
    by_rank = {i.dp_rank: i.address for i in decode}
    assert [node.info["ranks"] for node in mesh["nodes"]] == [[by_rank[0]], [by_rank[1]]]
    assert all(len(node.info["pids"]) == 1 for node in mesh["nodes"])


def test_answers_equal_the_single_process_engine(mesh, tiny_models):
    expected = offline_answers(str(tiny_models["qwen3_moe"]))
    assert concurrent_answers(mesh["url"]) == expected
    assert all(node.proc.poll() is None for node in mesh["nodes"])  # both nodes still up


def test_stopping_one_node_drains_and_stops_both(mesh):
    """(Last: it ends the mesh.) SIGTERM to node 1 alone - a node going away, as when its
    pod is deleted: its rank drains, tells rank 0 in the next lockstep exchange, and both
    ranks stop together, each launcher exiting by itself (rank 0's was never signalled;
    before, node 1 stepped on alone until killed, and rank 0 then died of a reset
    connection)."""
    import os
    import signal

    node0, node1 = mesh["nodes"]
    os.killpg(node1.proc.pid, signal.SIGTERM)
    assert node1.proc.wait(timeout=20) == 0
    node0.proc.wait(timeout=20)  # (it exits 1: its rank exited without being told)
    log = node0.log_path.read_text()
    assert "a data-parallel peer is draining; draining with it" in log
    assert "Connection reset by peer" not in log
