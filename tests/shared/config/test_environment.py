"""The environment variables the seeds' recipes export: each has a verdict, the ones
without effect are named at start-up with their reason, and the ones pdmesh reads take
effect (a gateway's wait on its instances, the ranks' collective timeout)."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from pdmesh.shared.config import environment
from pdmesh.shared.config.serve import serve_config
from pdmesh.shared.parallel.ranks import run_ranks

# every variable the seeds' recipes export (dsv4-deployment, the features' and
# SGLang's pages), with a value of the kind they give
SEED_EXPORTS = {
    "TASK_QUEUE_ENABLE": "1", "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    "LD_PRELOAD": "/usr/lib/libjemalloc.so.2", "OMP_PROC_BIND": "false",
    "OMP_NUM_THREADS": "10", "HCCL_OP_EXPANSION_MODE": "AIV", "HCCL_BUFFSIZE": "1024",
    "VLLM_RPC_TIMEOUT": "3600000", "VLLM_ASCEND_ENABLE_FLASHCOMM1": "1",
    "VLLM_ASCEND_APPLY_DSV4_PATCH": "1", "TP_SOCKET_IFNAME": "eth0",
    "LD_LIBRARY_PATH": "/usr/local/lib", "HCCL_SOCKET_IFNAME": "eth0",
    "HCCL_IF_IP": "10.0.0.1", "HCCL_CONNECT_TIMEOUT": "1200", "GLOO_SOCKET_IFNAME": "eth0",
    "VLLM_USE_V1": "1", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "30000",
    "VLLM_ASCEND_ENABLE_FUSED_MC2": "1", "HCCL_EXEC_TIMEOUT": "204",
    "ASCEND_TRANSFER_TIMEOUT": "100", "ASCEND_RT_VISIBLE_DEVICES": "0,1",
    "ASCEND_CONNECT_TIMEOUT": "100", "VLLM_VERSION": "0.18.0",
    "VLLM_ENGINE_READY_TIMEOUT_S": "1200", "VLLM_ASCEND_ENABLE_PREFETCH_MLP": "1",
    "VLLM_ASCEND_ENABLE_FLASHCOMM": "1", "VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE": "1",
    "USE_MULTI_GROUPS_KV_CACHE": "1", "USE_MULTI_BLOCK_POOL": "1", "DYNAMIC_EPLB": "true",
}
WITHOUT_EFFECT = {"TP_SOCKET_IFNAME", "VLLM_VERSION", "VLLM_ASCEND_ENABLE_PREFETCH_MLP",
                  "VLLM_ASCEND_ENABLE_FLASHCOMM", "VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE"}


def test_every_variable_the_seeds_export_has_a_verdict():
    for name in SEED_EXPORTS:
        v = environment.verdict(name)
        assert v is not None and v.note, name
        assert (v.verdict == environment.NONE) == (name in WITHOUT_EFFECT), name


def test_start_up_names_each_variable_without_effect_and_why(tmp_path):
    config = serve_config("serve", [str(tmp_path)], env={**SEED_EXPORTS, "VLLM_FOO": "1"},
                          device="cpu")
    said = [w for w in config.flag_warnings if w.startswith("environment variable")]
    named = {w.split()[2].rstrip(":") for w in said}
    assert named == WITHOUT_EFFECT | {"VLLM_FOO"}, said
    assert any("VLLM_ASCEND_ENABLE_FLASHCOMM1" in w for w in said)  # (the new name)
    # a gateway or any other command says so too
    gateway = serve_config("gateway", ["--model", str(tmp_path)],
                           env={"VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE": "1"}, device="cpu")
    assert any("VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE" in w for w in gateway.flag_warnings)
    v0 = serve_config("serve", [str(tmp_path)], env={"VLLM_USE_V1": "0"}, device="cpu")
    assert any("VLLM_USE_V1" in w for w in v0.flag_warnings)


def test_a_slow_tokenizer_mode_is_said_to_be_read_as_auto(tmp_path):
    slow = serve_config("serve", [str(tmp_path), "--tokenizer-mode", "slow"], env={},
                        device="cpu")
    assert any(w.startswith("--tokenizer-mode slow: read as auto")
               for w in slow.flag_warnings), slow.flag_warnings
    auto = serve_config("serve", [str(tmp_path)], env={}, device="cpu")
    assert not any("--tokenizer-mode" in w for w in auto.flag_warnings)


@pytest.mark.parametrize(("name", "value"), [("VLLM_RPC_TIMEOUT", "soon"),
                                             ("VLLM_RPC_TIMEOUT", "-5"),
                                             ("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "0")])
def test_a_bad_timeout_is_refused_by_name(tmp_path, name, value):
    with pytest.raises(ValueError, match=name):
        serve_config("serve", [str(tmp_path)], env={name: value}, device="cpu")


def test_vllm_rpc_timeout_is_how_long_the_gateway_waits_on_an_instance(qwen3_path,
                                                                       registry_prefix):
    """The variable (milliseconds) becomes the gateway's retry policy's wait on a prefill
    call or a decode stream's silence, as the gateway service builds it."""
    from pdmesh.services.gateway.app import Gateway, GatewayState
    from pdmesh.services.gateway.router import Router
    from pdmesh.shared.infra.registry import Registry
    from pdmesh.shared.models.tokenizer import Tokenizer

    assert environment.rpc_timeout_s({"VLLM_RPC_TIMEOUT": "3600000"}) == 3600
    assert environment.rpc_timeout_s({}) == 600
    router = Router(Registry("redis://127.0.0.1:6379/0", registry_prefix), "m")
    state = GatewayState(tokenizer=Tokenizer(str(qwen3_path)), router=router, model_name="m",
                         max_model_len=64,
                         rpc_timeout_s=environment.rpc_timeout_s({"VLLM_RPC_TIMEOUT": "250"}))
    assert Gateway(state).mesh.retry.timeout_s == 0.25


def _collective_waits(rank: int, world: int, address: str) -> float:
    """Rank 1 never joins the all-reduce: rank 0's fails after the variable's time."""
    import os

    from pdmesh.shared.parallel.expert_parallel import init_group

    os.environ["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = "1"
    init_group(rank, world, address, "cpu")
    import torch

    start = time.monotonic()
    if rank == 0:
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.ones(1))
        return time.monotonic() - start
    time.sleep(3)
    return 0.0


def test_vllm_execute_model_timeout_bounds_a_rank_s_wait_for_the_others():
    waited = run_ranks(_collective_waits, 2, timeout_s=60)[0]
    assert 0.8 <= waited < 2.9, waited  # (the default would be 120 s)

