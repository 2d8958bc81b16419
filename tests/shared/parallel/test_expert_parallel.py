"""Expert parallelism over two real rank processes (gloo on loopback): every rank's
greedy output equals the single-process engine's, also while placements move."""

from __future__ import annotations

import pytest
import torch

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.parallel.expert_parallel import LayerPlacement, identity_placement
from pdmesh.shared.parallel.ranks import barrier, lockstep, run_ranks

PROMPTS = [list(range(40, 75)), [5, 9, 200, 14], list(range(300, 330)), [77] * 20,
           list(range(1000, 1012))]
NEW = 12


def rank_main(rank: int, world: int, address: str, model: str,
              shares: list[list[list[int]]], redundant: int, moves: list,
              expert_map: str | None, speculative: dict | None, quantization: str | None
              ) -> tuple:
    """One DP rank: its share of the prompts (``shares[rank]``), stepped in lockstep
    with the others; after ``moves[i][0]`` steps, every rank switches MoE layer
    moves[i][1] to moves[i][2]. ``speculative``: the ranks draft and verify (their step
    sizes then differ more)."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from pdmesh.shared.engine.build import build_engine
    from pdmesh.shared.engine.config import EngineConfig

    eng = build_engine(EngineConfig(
        model=model, device="cpu", dtype="float32", block_size=16,
        data_parallel_size=world, data_parallel_rank=rank, data_parallel_address=address,
        enable_expert_parallel=True, num_redundant_experts=redundant,
        expert_load_window=8, expert_map_path=expert_map,
        speculative_config=speculative, quantization=quantization))
    ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=NEW,
                                             ignore_eos=True)).request_id
           for p in shares[rank]]
    tokens = {rid: [] for rid in ids}
    moved = 0
    for step in lockstep(eng):
        for at, layer, phy2log in moves:
            if at == step:
                moved += eng.ep.move_experts(layer, torch.tensor(phy2log))
        for o in eng.step():
            tokens[o.request.request_id] += o.new_token_ids
    load = eng.model.load_recorder.load()
    dist.destroy_process_group()
    return [tokens[r] for r in ids], moved, load.sum().item(), eng.spec_stats.num_drafts


def run_ep_ranks(model: str, shares: list[list[list[int]]], redundant: int = 0,
                 moves: list | None = None, expert_map: str | None = None,
                 speculative: dict | None = None, quantization: str | None = None
                 ) -> dict[int, tuple]:
    """rank -> (its outputs, expert bytes moved, expert load recorded, drafts verified)."""
    return run_ranks(rank_main, len(shares), model, shares, redundant, moves or [],
                     expert_map, speculative, quantization, timeout_s=240)


@pytest.fixture(scope="module")
def moe_path(tiny_models):
    return str(tiny_models["qwen3_moe"])


@pytest.fixture(scope="module")
def expected(moe_path):
    llm = LLM(moe_path, device="cpu", dtype="float32", block_size=16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_two_ranks_equal_the_single_process_engine(moe_path, expected):
    # rank 1 gets one short prompt: it idles (serving rank 0's tokens) for most steps
    shares = [PROMPTS[:2] + PROMPTS[3:], [PROMPTS[2]]]
    res = run_ep_ranks(moe_path, shares)
    assert res[0][0] == expected[:2] + expected[3:]
    assert res[1][0] == [expected[2]]
    assert res[0][2] > 0 and res[1][2] > 0  # both recorded expert load


def test_two_ranks_drafting_equal_the_single_process_engine(moe_path, expected):
    """n-gram speculation on expert-parallel ranks: each rank verifies its own drafts
    (steps of uneven sizes in lockstep) and the greedy answers stay the same."""
    shares = [PROMPTS[:2] + PROMPTS[3:], [PROMPTS[2]]]
    res = run_ep_ranks(moe_path, shares, speculative={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "adaptive_drafts": False})
    assert res[0][0] == expected[:2] + expected[3:]
    assert res[1][0] == [expected[2]]
    assert res[0][3] + res[1][3] > 0  # drafts were verified


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_two_ranks_drafting_with_mtp_equal_the_single_process_engine(tiny_models, arch):
    """MTP on expert-parallel ranks: the target's MoE layers all-to-all in lockstep, the
    MTP layer's experts held whole on each rank (no collective, so ranks may draft
    differently); the greedy answers stay the single-process engine's."""
    path = str(tiny_models[arch])
    want = [o.outputs[0].token_ids for o in LLM(path, device="cpu", dtype="float32",
                                                 block_size=16).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))]
    shares = [PROMPTS[:2] + PROMPTS[3:], [PROMPTS[2]]]
    res = run_ep_ranks(path, shares, speculative={
        "method": "deepseek_mtp", "num_speculative_tokens": 2, "adaptive_drafts": False})
    assert res[0][0] == want[:2] + want[3:]
    assert res[1][0] == [want[2]]
    assert res[0][3] > 0 and res[1][3] > 0  # both ranks drafted


def test_redundant_experts_and_live_moves_keep_the_output(moe_path, expected):
    """Two redundant slots, and every MoE layer's placement changed mid-generation."""
    from pdmesh.shared.models.config import ModelConfig

    cfg = ModelConfig.from_folder(moe_path)
    n_moe = sum(cfg.moe.is_moe_layer(i) for i in range(cfg.num_layers))
    experts, slots = cfg.moe.num_experts, cfg.moe.num_experts + 2
    g = torch.Generator().manual_seed(3)
    moves = []
    for layer in range(n_moe):
        perm = torch.cat([torch.randperm(experts, generator=g),
                          torch.randint(0, experts, (2,), generator=g)])
        moves.append((2 + layer, layer, perm.tolist()))
    shares = [PROMPTS[:3], PROMPTS[3:]]
    res = run_ep_ranks(moe_path, shares, redundant=2, moves=moves)
    assert res[0][0] == expected[:3] and res[1][0] == expected[3:]
    assert res[0][1] > 0 and res[1][1] > 0  # weights really crossed between the ranks
    assert identity_placement(n_moe, experts, slots).shape == (n_moe, slots)


@pytest.mark.parametrize("scheme", ["w8a8_dynamic", "w4a8_dynamic"])
def test_quantized_experts_move_with_their_scales(tiny_models, tmp_path, scheme):
    """modelslim experts over two EP ranks, redundant slots and live moves: the int8
    weights travel with their per-channel scales (a scale left behind would change the
    answers), and the answers are the single-process quantized engine's."""
    from pdmesh.shared.cli.quantize import quantize_checkpoint
    from pdmesh.shared.models.config import ModelConfig

    path = str(tmp_path / scheme)
    quantize_checkpoint(tiny_models["qwen3_moe"], path, scheme)
    llm = LLM(path, device="cpu", dtype="float32", block_size=16, quantization="ascend")
    want = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))]
    cfg = ModelConfig.from_folder(path)
    g = torch.Generator().manual_seed(7)
    moves = [(2 + layer, layer, torch.cat([torch.randperm(cfg.moe.num_experts, generator=g),
                                           torch.randint(0, cfg.moe.num_experts, (2,),
                                                         generator=g)]).tolist())
             for layer in range(cfg.num_layers)]
    res = run_ep_ranks(path, [PROMPTS[:3], PROMPTS[3:]], redundant=2, moves=moves,
                    quantization="ascend")
    assert res[0][0] == want[:3] and res[1][0] == want[3:]
    # whole experts crossed: every tensor they are held as (the int8 weight, its scales,
    # the backend's own tiles), never a part of one
    from pdmesh.shared.kernels.quant import expert_tensors

    mlp = llm.engine.model.w.layers[0].mlp
    per_expert = sum(t[0].numel() * t.element_size()
                     for w in (mlp.w13, mlp.w2) for t in expert_tensors(w))
    assert mlp.w13.weight.dtype == torch.int8
    for rank in (0, 1):
        assert res[rank][1] > 0 and res[rank][1] % per_expert == 0, (res[rank][1], per_expert)


def test_layer_placement_maps_agree():
    p = LayerPlacement.from_phy2log(torch.tensor([2, 0, 2, 1, 2, 0]), 3)
    assert p.logcnt.tolist() == [2, 1, 3]
    assert p.log2phy[0, :2].tolist() == [1, 5] and p.log2phy[2, :3].tolist() == [0, 2, 4]
    assert (p.log2phy[1, 1:] == -1).all()


def test_static_expert_map_from_a_recorded_file(moe_path, expected, tmp_path):
    """expert_map_path: a placement recorded earlier (save_expert_map writes what
    expert_map_record_path records) is where the ranks start."""
    from pdmesh.shared.models.config import ModelConfig
    from pdmesh.shared.parallel.eplb_rank import save_expert_map

    cfg = ModelConfig.from_folder(moe_path)
    n_moe = sum(cfg.moe.is_moe_layer(i) for i in range(cfg.num_layers))
    experts = cfg.moe.num_experts
    reversed_map = torch.arange(experts - 1, -1, -1).repeat(n_moe, 1)  # expert 7 in slot 0
    path = tmp_path / "map.json"
    save_expert_map(str(path), reversed_map, version=3)
    res = run_ep_ranks(moe_path, [PROMPTS[:2], PROMPTS[2:]], expert_map=str(path))
    assert res[0][0] == expected[:2] and res[1][0] == expected[2:]


def test_bad_expert_maps_are_named(tmp_path):
    from pdmesh.shared.parallel.expert_parallel import load_expert_map

    path = tmp_path / "m.json"
    path.write_text('{"phy2log": [[0, 1, 2]]}')
    with pytest.raises(ValueError, match="expert_map_path: phy2log is \\[1, 3\\]"):
        load_expert_map(path, num_layers=1, num_experts=4, num_slots=4)
    path.write_text('{"phy2log": [[0, 1, 1, 2]]}')
    with pytest.raises(ValueError, match="no slot for expert"):
        load_expert_map(path, num_layers=1, num_experts=4, num_slots=4)
    path.write_text("not json")
    with pytest.raises(ValueError, match="expert_map_path: cannot read"):
        load_expert_map(path, num_layers=1, num_experts=4, num_slots=4)


def test_bench_eplb_rebalances_a_skewed_model(tmp_path, bpe_tokenizer):
    """`pdmesh bench eplb` end to end on a skewed tiny model (figures, not timings, are
    checked): the placement it computes from the measured load balances it."""
    import json
    import subprocess
    import sys

    from pdmesh.shared.models.tiny import make_tiny_model

    skewed = make_tiny_model(tmp_path / "skewed", "qwen3_moe", tokenizer=bpe_tokenizer,
                             expert_skew=0.3)
    out = tmp_path / "eplb.json"
    run = subprocess.run([sys.executable, "-m", "pdmesh", "bench", "eplb", "--model",
                          str(skewed), "--num-prompts", "4", "--output-len", "6",
                          "--input-len", "16", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    res = json.loads(out.read_text())["skewed"]
    assert res["off"]["balancedness"] < 0.8 < 0.9 < res["on"]["balancedness"]
    assert res["on"]["tok_s"] > 0 and "EPLB on / off" in run.stdout


def test_bench_dyntralb_reports_each_pass(tmp_path, moe_path):
    """`pdmesh bench dyntralb` end to end (figures, not timings, are checked): both
    passes serve every token of the same workload; with DyntraLB on the skewed rank's
    bubble is measured and its plan runs."""
    import argparse
    import json
    import subprocess
    import sys

    from pdmesh.shared.cli.bench.dyntralb import add_args, workload

    out = tmp_path / "lb.json"
    args = ["--model", moe_path, "--num-prompts", "6", "--output-len", "8",
            "--input-len", "16", "--max-num-seqs", "2", "--bubble-threshold", "1",
            "--passes", "off,vllm_ascend", "--json", str(out),
            "--record-loads", str(tmp_path / "loads.jsonl")]
    run = subprocess.run([sys.executable, "-m", "pdmesh", "bench", "dyntralb", *args],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    res = json.loads(out.read_text())
    assert set(res) == {"off", "vllm_ascend"}
    p = argparse.ArgumentParser()
    add_args(p)
    a = p.parse_args(args)
    from pdmesh.shared.models.config import ModelConfig

    vocab = ModelConfig.from_folder(moe_path).vocab_size
    want = sum(n for r in range(2) for _, n in workload(a, r, vocab))
    for r in res.values():
        assert r["tok_s"] * r["wall_s"] == pytest.approx(want)
        assert r["bubble_mean"] > 0 and r["tpot_ms_p50"] > 0
    assert res["off"]["pauses"] == 0
    assert "vllm_ascend" in run.stdout and "bubble" in run.stdout
    # --record-loads: the plans of the pass with DyntraLB on, replayable by the planner
    from pdmesh.shared.engine.dyntralb import RankLoad, balance_load

    plans = [json.loads(line) for line in (tmp_path / "loads.jsonl").read_text().splitlines()]
    assert plans and all(len(p["loads"]) == 2 and p["max_num_seqs"] == 2 for p in plans)
    for p in plans:
        moves = balance_load([RankLoad(r, w) for r, w in p["loads"]], 2, 1.0)
        assert [{"out_blk": m.out, "in_blk": m.into, "freeze": m.freeze}
                for m in moves] == p["moves"]


def loop_rank_main(rank: int, world: int, address: str, model: str,
                   shares: list[list[list[int]]], barrier, max_num_seqs: int) -> tuple:
    """One rank served by the real lockstep EngineLoop with DyntraLB on: its outputs
    and how often its scheduler paused a request."""
    import threading

    torch.set_num_threads(1)
    from pdmesh.shared.config.scheduler_schema import DyntraLBConfig
    from pdmesh.shared.engine.build import build_engine
    from pdmesh.shared.engine.config import EngineConfig
    from tests.shared.runtime.driver import LoopDriver

    lb = DyntraLBConfig(enabled=True, mode="static", start_step=0, bubble_threshold=2.0)
    eng = build_engine(EngineConfig(
        model=model, device="cpu", dtype="float32", block_size=16,
        max_num_seqs=max_num_seqs,
        data_parallel_size=world, data_parallel_rank=rank, data_parallel_address=address,
        enable_expert_parallel=True, dyntra_lb=lb))
    driver = LoopDriver(eng, start=False)  # the loop runs in this (main) thread
    loop = driver.loop
    streams = [driver.submit(p, SamplingParams(temperature=0, max_tokens=NEW,
                                               ignore_eos=True)) for p in shares[rank]]
    tokens: list[list[int]] = [[] for _ in streams]
    errors: list[str] = []

    def collect():
        try:
            for i, s in enumerate(streams):
                while True:
                    ev = s.get(timeout=240)
                    if ev.error is not None:
                        raise RuntimeError(ev.error)
                    tokens[i] += ev.token_ids
                    if ev.finished:
                        break
            barrier.wait(240)  # every rank done: now all may stop together
        except Exception as e:  # noqa: BLE001 (raised in the rank's main thread)
            errors.append(repr(e))
        finally:
            loop.stop()

    t = threading.Thread(target=collect)
    t.start()
    loop.run()
    t.join()
    if errors:
        raise RuntimeError(errors[0])
    return tokens, eng.scheduler.pauses


def test_dyntralb_pauses_on_the_heavy_rank_and_keeps_every_answer(moe_path, tiny_models):
    """Rank 0 holds two long prompts and three short ones, two seats; rank 1 one short
    prompt: DyntraLB swaps a running long request on rank 0 for a waiting short one
    (a pause with its KV kept), and every answer still equals the single-process one."""
    heavy = [list(range(100 + 50 * i, 400 + 50 * i)) for i in range(2)]
    heavy += [list(range(20 + 7 * i, 40 + 7 * i)) for i in range(3)]
    light = [[3, 4, 5, 6]]
    llm = LLM(moe_path, device="cpu", dtype="float32", block_size=16)
    want = [o.outputs[0].token_ids for o in llm.generate(
        heavy + light, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))]
    got = run_ranks(loop_rank_main, 2, moe_path, [heavy, light], barrier(2), 2,
                    timeout_s=300)
    assert got[0][0] == want[:5] and got[1][0] == want[5:]
    assert got[0][1] > 0  # the heavy rank paused requests


def test_deepseek_moe_over_two_ranks_with_moves_equals_one_process(tiny_models):
    """DeepSeekMoE (grouped sigmoid routing with a correction bias, shared experts on
    every rank, dense first layer) over two EP ranks, a redundant slot and live moves."""
    from pdmesh.shared.models.config import ModelConfig

    path = str(tiny_models["deepseek_v3"])
    llm = LLM(path, device="cpu", dtype="float32", block_size=16)
    want = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))]
    cfg = ModelConfig.from_folder(path)
    n_moe = sum(cfg.moe.is_moe_layer(i) for i in range(cfg.num_layers))
    g = torch.Generator().manual_seed(5)
    moves = [(3 + layer, layer, torch.cat([torch.randperm(cfg.moe.num_experts, generator=g),
                                           torch.randint(0, cfg.moe.num_experts, (2,),
                                                         generator=g)]).tolist())
             for layer in range(n_moe)]
    res = run_ep_ranks(path, [PROMPTS[:2], PROMPTS[2:]], redundant=2, moves=moves)
    assert res[0][0] == want[:2] and res[1][0] == want[2:]
    assert res[0][1] > 0 and res[1][1] > 0 and res[0][2] > 0


def test_deepseek_v4_moe_over_two_ranks_with_moves_equals_one_process(tiny_models):
    """DeepSeek-V4's MoE (hash layers choosing experts by token id, sqrtsoftplus top-k
    with a correction bias, a clamped swiglu, a shared expert on every rank) over two EP
    ranks, a redundant slot and live moves, with sliding / compressed attention around
    it; prompts long enough to cross the window and several compression windows."""
    from pdmesh.shared.models.config import ModelConfig

    path = str(tiny_models["deepseek_v4"])
    prompts = [list(range(40, 140)), [5, 9, 200, 14], list(range(300, 370)), [77] * 40]
    llm = LLM(path, device="cpu", dtype="float32", block_size=16)
    want = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))]
    cfg = ModelConfig.from_folder(path)
    assert any(cfg.v4.hash_layers) and not all(cfg.v4.hash_layers)
    g = torch.Generator().manual_seed(6)
    moves = [(3 + layer, layer, torch.cat([torch.randperm(cfg.moe.num_experts, generator=g),
                                           torch.randint(0, cfg.moe.num_experts, (2,),
                                                         generator=g)]).tolist())
             for layer in range(cfg.num_layers)]
    res = run_ep_ranks(path, [prompts[:2], prompts[2:]], redundant=2, moves=moves)
    assert res[0][0] == want[:2] and res[1][0] == want[2:]
    assert res[0][1] > 0 and res[1][1] > 0 and res[0][2] > 0
