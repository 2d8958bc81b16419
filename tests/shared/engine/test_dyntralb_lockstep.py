"""Where DyntraLB plans: DP ranks that step together. A MoE model's DP ranks without
expert parallelism step together for it (vLLM-Ascend runs its DP engine core there), as
fine-grained TP's do; a dense model's do not, and it says so."""

from __future__ import annotations

import logging

import pytest
import torch

from pdmesh.shared.config.scheduler_schema import DyntraLBConfig
from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.parallel.ranks import run_ranks

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 7, 200, 9, 9, 9], [77] * 11]


def dp_rank(rank: int, world: int, address: str, model: str, shares, fine) -> tuple:
    import torch.distributed as dist

    from pdmesh.shared.engine.build import build_engine
    from pdmesh.shared.engine.config import EngineConfig
    from pdmesh.shared.parallel.ranks import lockstep

    torch.set_num_threads(1)
    eng = build_engine(EngineConfig(
        model=model, device="cpu", dtype="float32", block_size=16, data_parallel_size=world,
        data_parallel_rank=rank, data_parallel_address=address, finegrained_tp_config=fine,
        dyntra_lb=DyntraLBConfig(enabled=True, mode="static", start_step=1)))
    reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
            for p in shares[rank]]
    for _ in lockstep(eng):
        eng.step()
    dist.destroy_process_group()
    return [r.output_token_ids for r in reqs], eng.lockstep, eng.dyntralb is not None


@pytest.mark.parametrize(("arch", "fine"), [
    ("qwen3_moe", None), ("qwen3", {"oproj_tensor_parallel_size": 2})])
def test_dyntralb_plans_on_ranks_that_step_together(tiny_models, arch, fine):
    path = str(tiny_models[arch])
    want = [o.outputs[0].token_ids for o in LLM(path, device="cpu", dtype="float32",
                                                block_size=16).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]
    got = run_ranks(dp_rank, 2, path, [PROMPTS[:2], PROMPTS[2:]], fine, timeout_s=240)
    for rank, rows in ((0, slice(0, 2)), (1, slice(2, 4))):
        tokens, lockstep, planned = got[rank]
        assert lockstep and planned, (rank, lockstep, planned)
        assert tokens == want[rows]


def test_a_dense_model_s_dp_ranks_say_dyntralb_is_without_effect(tiny_models, caplog):
    from pdmesh.shared.engine.build import build_engine
    from pdmesh.shared.engine.config import EngineConfig

    with caplog.at_level(logging.WARNING):
        eng = build_engine(EngineConfig(
            model=str(tiny_models["qwen3"]), device="cpu", dtype="float32",
            data_parallel_size=2, data_parallel_rank=0, data_parallel_address="127.0.0.1:1",
            dyntra_lb=DyntraLBConfig(enabled=True)))
    assert eng.dyntralb is None and not eng.lockstep
    assert "dyntra_lb_config: without effect: these DP ranks do not step together" in \
        caplog.text
