"""Which ranks a node runs and which devices each gets (multi-node DP, as vLLM's
--data-parallel-size-local / --data-parallel-start-rank)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdmesh.shared.runtime.dp_launcher import device_env, local_ranks


def flags(size, local=None, start=0, port=None, address=None):
    return SimpleNamespace(data_parallel_size=size, data_parallel_size_local=local,
                           data_parallel_start_rank=start, data_parallel_rpc_port=port,
                           data_parallel_address=address)


def test_a_node_runs_its_own_ranks():
    assert local_ranks(flags(4)) == range(0, 4)
    assert local_ranks(flags(16, local=8, port=13355)) == range(0, 8)
    assert local_ranks(flags(16, local=8, start=8, port=13355, address="10.0.0.1")) \
        == range(8, 16)


@pytest.mark.parametrize("kw, flag", [
    ({"size": 4, "start": 4}, "--data-parallel-start-rank"),
    ({"size": 4, "start": -1}, "--data-parallel-start-rank"),
    ({"size": 4, "local": 3, "start": 2, "port": 1, "address": "h"},
     "--data-parallel-size-local"),
    ({"size": 4, "local": 0}, "--data-parallel-size-local"),
    ({"size": 4, "local": 2}, "--data-parallel-rpc-port"),
    ({"size": 4, "local": 2, "start": 2, "port": 13355}, "--data-parallel-address"),
])
def test_splits_that_cannot_work_name_the_flag(kw, flag):
    size = kw.pop("size")
    with pytest.raises(ValueError, match=flag):
        local_ranks(flags(size, **kw))


def test_each_local_rank_gets_its_own_devices():
    assert device_env("cpu", 3) == {}
    assert device_env("npu", 0, environ={}) == {"ASCEND_RT_VISIBLE_DEVICES": "0"}
    assert device_env("npu", 5, environ={}) == {"ASCEND_RT_VISIBLE_DEVICES": "5"}
    assert device_env("cuda", 1, per_rank=2, environ={}) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    # the node's visible devices, in their order
    env = {"ASCEND_RT_VISIBLE_DEVICES": "4,5, 6,7"}
    assert [device_env("npu", i, environ=env) for i in range(4)] == [
        {"ASCEND_RT_VISIBLE_DEVICES": d} for d in ("4", "5", "6", "7")]
    with pytest.raises(ValueError, match="ASCEND_RT_VISIBLE_DEVICES=4,5, 6,7: 4 device"):
        device_env("npu", 4, environ=env)
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        device_env("cuda", 1, per_rank=2, environ={"CUDA_VISIBLE_DEVICES": "0,1,2"})
