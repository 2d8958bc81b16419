"""Tensor parallelism inside one engine: two rank processes (gloo on loopback), each
with its slice of every layer read straight from the safetensors, compute what one
process computes: the logits within float32 rounding at every step, the greedy output
the same."""

from __future__ import annotations

import logging
import os
import re
import signal
import time

import pytest
import torch

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.models.config import ModelConfig, local_config
from pdmesh.shared.models.transformer import weight_bytes
from pdmesh.shared.parallel.ranks import lockstep, run_ranks
from pdmesh.shared.parallel.tensor_parallel import Shard
from pdmesh.shared.parallel.tp_ranks import TensorParallelRanks

PROMPTS = [list(range(40, 75)), [5, 9, 200, 14], list(range(300, 345)), [77] * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(llm: LLM) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The logits the engine sampled from at every step, and the outputs."""
    with llm.engine.runner.logits_kept() as kept:
        outs = llm.generate(PROMPTS, GREEDY)
    return kept, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe", "deepseek_v3", "deepseek_v4"])
def test_two_ranks_compute_what_one_computes(tiny_models, arch):
    path = str(tiny_models[arch])
    want_logits, want = run(LLM(path, device="cpu", dtype="float32", block_size=16))
    tp = LLM(path, device="cpu", dtype="float32", block_size=16, tensor_parallel_size=2)
    try:
        model = tp.engine.model
        full = ModelConfig.from_folder(path)
        # rank 0 holds its half of the heads, the MLP and the vocabulary
        assert model.config.num_heads == full.num_heads // 2
        assert model.w.embed.shape[0] == -(-full.vocab_size // 2)
        got_logits, got = run(tp)
    finally:
        tp.close()
    assert got == want
    assert len(got_logits) == len(want_logits)
    for a, b in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_shards_are_named_when_they_do_not_divide(tiny_models):
    cfg = ModelConfig.from_folder(tiny_models["qwen3"])
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 3 does not divide "
                                         r"num_attention_heads \(8\)"):
        local_config(cfg, Shard(0, 3))
    # more ranks than K / V heads: each rank reads the one its query heads use
    local = local_config(cfg, Shard(3, 4))
    assert (local.num_heads, local.num_kv_heads) == (2, 1)
    assert Shard(3, 4).kv_heads(2) == slice(1, 2)
    # DeepSeek-V4: each rank its groups of the grouped output projection, whole heads
    v4 = ModelConfig.from_folder(tiny_models["deepseek_v4"])
    assert local_config(v4, Shard(1, 2)).v4.o_groups * 2 == v4.v4.o_groups
    with pytest.raises(ValueError, match=rf"tensor_parallel_size: {v4.v4.o_groups * 2} does "
                                         rf"not divide"):
        local_config(v4, Shard(0, v4.v4.o_groups * 2))


@pytest.mark.parametrize(("arch", "spec"), [
    ("qwen3", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
    ("deepseek_v3", {"method": "deepseek_mtp", "num_speculative_tokens": 2,
                     "adaptive_drafts": False}),
    ("deepseek_v4", {"method": "deepseek_mtp", "num_speculative_tokens": 2,
                     "adaptive_drafts": False})])
def test_speculative_decoding_under_tensor_parallelism_keeps_the_greedy_answers(
        tiny_models, arch, spec):
    """Drafts verified at TP2 (MTP: every rank runs its shard of the MTP layer, rank 0
    handing each draft step on): the greedy answers are TP1's without drafting."""
    path = str(tiny_models[arch])
    _, want = run(LLM(path, device="cpu", dtype="float32", block_size=16))
    tp = LLM(path, device="cpu", dtype="float32", block_size=16, tensor_parallel_size=2,
             speculative_config=spec)
    try:
        got = [o.outputs[0].token_ids for o in tp.generate(PROMPTS, GREEDY)]
        drafts = tp.engine.spec_stats.num_drafts
        if arch == "deepseek_v3":  # rank 0 holds half of the MTP layer's heads
            mtp = tp.engine.model.w.mtp[0].layer.attn
            assert mtp.w_uk.shape[0] * 2 == ModelConfig.from_folder(path).num_heads
    finally:
        tp.close()
    assert got == want
    assert drafts > 0


def test_rank_memory_is_reported_at_start_up(tiny_models, caplog):
    path = str(tiny_models["qwen3"])
    one = LLM(path, device="cpu", dtype="float32", block_size=16, num_kv_blocks=64)
    whole = weight_bytes(one.engine.model.w)
    with caplog.at_level(logging.INFO, logger="pdmesh.shared.engine.build"):
        tp = LLM(path, device="cpu", dtype="float32", block_size=16, num_kv_blocks=64,
                 tensor_parallel_size=2)
    try:
        line = next(r.getMessage() for r in caplog.records
                    if "tensor-parallel memory per rank" in r.getMessage())
        got = re.search(r"weights ([\d.]+) / ([\d.]+) MB, KV cache ([\d.]+) MB", line)
        assert got, line
        ranks = [float(got[1]) * 1e6, float(got[2]) * 1e6]
        # each rank holds about half the weights (norms are replicated; the vocabulary,
        # heads and MLP split), and half the KV heads of the same 64 blocks
        for b in ranks:
            assert 0.45 * whole < b < 0.6 * whole, (b, whole)
        kv_tp1 = (64 + 1) * one.engine.cache_spec.groups[0].block_bytes(torch.float32)
        assert float(got[3]) * 1e6 == pytest.approx(kv_tp1 / 2, rel=0.01)
    finally:
        tp.close()


def failing_worker(config, rank, topology, messages):
    """A worker whose shard cannot load (what a corrupt slice or a missing device does)."""
    from pdmesh.shared.parallel.tp_ranks import report_failure

    try:
        raise OSError(f"rank {rank}: cannot read its slice of the checkpoint")
    except OSError as e:
        report_failure(messages, rank, e)
        raise


def test_a_rank_that_fails_to_start_ends_start_up_with_its_error(tiny_models):
    from pdmesh.shared.engine import EngineConfig

    config = EngineConfig(model=str(tiny_models["qwen3"]), device="cpu")
    ranks = TensorParallelRanks(config, 2, failing_worker)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 failed to start: "
                                           r"OSError\('rank 1: cannot read its slice"):
        ranks.join(timeout_s=60)
    assert time.monotonic() - t0 < 30  # not the collective timeout
    assert all(not w.is_alive() for w in ranks.workers)


def test_a_rank_that_dies_ends_the_next_step_with_its_exit(tiny_models):
    tp = LLM(str(tiny_models["qwen3"]), device="cpu", dtype="float32", block_size=16,
             tensor_parallel_size=2)
    try:
        worker = tp.engine.tp_ranks.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 exited \(code -9\)"):
            tp.generate([[5, 6, 7]], GREEDY)
        assert time.monotonic() - t0 < 30
    finally:
        tp.close()


@pytest.mark.parametrize(("arch", "prefill_tp", "decode_tp", "kv"),
                         [("qwen3", 2, 1, "auto"), ("qwen3", 1, 2, "auto"),
                          ("deepseek_v3", 2, 1, "auto"), ("llama", 1, 2, "int8"),
                          ("deepseek_v4", 1, 2, "auto")])
def test_prefill_and_decode_at_different_tp_sizes_share_the_pool(tiny_models, arch,
                                                                   prefill_tp, decode_tp, kv):
    """A prefill engine at TP a puts whole blocks; a decode engine at TP b reads the heads
    it holds: decode computes no prompt token and answers as one engine does (MLA: the
    latent, the same on every rank; int8 KV: each head's scales travel with it)."""
    from pdmesh.shared.engine import EngineConfig, EngineCore, build_engine
    from pdmesh.shared.kvpool import InProcessPool

    path = str(tiny_models[arch])
    _, want = run(LLM(path, device="cpu", dtype="float32", block_size=16,
                      kv_cache_dtype=kv))
    pool = InProcessPool()

    def engine(tp: int, producer: bool) -> EngineCore:
        return build_engine(EngineConfig(model=path, device="cpu", dtype="float32",
                                         block_size=16, tensor_parallel_size=tp,
                                         kv_cache_dtype=kv),
                            kv_pool=pool, save_prompts=producer)

    prefill = engine(prefill_tp, True)
    try:
        first = [prefill.add_request(p, SamplingParams(temperature=0, max_tokens=1,
                                                       ignore_eos=True)) for p in PROMPTS]
        while prefill.has_unfinished():
            prefill.step()
        assert all(r.kv_keys for r in first)
        assert prefill.kv.num_free_blocks == prefill.kv.num_blocks
    finally:
        prefill.close()
    decode = engine(decode_tp, False)
    try:
        reqs = [decode.add_request(p, GREEDY, output_token_ids=r.output_token_ids)
                for p, r in zip(PROMPTS, first, strict=True)]
        while decode.has_unfinished():
            decode.step()
        assert [r.num_cached_tokens for r in reqs] == [len(p) for p in PROMPTS]
        assert [r.output_token_ids for r in reqs] == want
        assert decode.kv.num_free_blocks == decode.kv.num_blocks
    finally:
        decode.close()



def test_a_tensor_parallel_decode_engine_steps_while_its_pool_reads_run(tiny_models):
    """A TP2 decode engine reads a prompt from the pool beside its steps: while the read
    is held up (the pool's get waits here) the running request keeps decoding; once it
    is in, the ranks get their heads between two steps and both answer as one engine."""
    import threading

    from pdmesh.shared.engine import EngineConfig, build_engine
    from pdmesh.shared.kvpool import InProcessPool

    class HeldPool(InProcessPool):
        """Gets wait for ``gate`` while ``hold`` is set (a slow read)."""

        def __init__(self) -> None:
            super().__init__()
            self.hold, self.gate, self.waiting = False, threading.Event(), threading.Event()

        def get(self, keys, regions):
            if self.hold:
                self.waiting.set()
                assert self.gate.wait(60)
            return super().get(keys, regions)

    path = str(tiny_models["qwen3"])
    _, want = run(LLM(path, device="cpu", dtype="float32", block_size=16))
    pool = HeldPool()

    def engine(tp: int, producer: bool):
        return build_engine(EngineConfig(model=path, device="cpu", dtype="float32",
                                         block_size=16, tensor_parallel_size=tp),
                            kv_pool=pool, save_prompts=producer)

    prefill = engine(1, True)
    first = [prefill.add_request(p, SamplingParams(temperature=0, max_tokens=1,
                                                   ignore_eos=True)) for p in PROMPTS[2:]]
    while prefill.has_unfinished():
        prefill.step()
    decode = engine(2, False)
    try:
        a = decode.add_request(PROMPTS[2], GREEDY, output_token_ids=first[0].output_token_ids)
        while a.num_output_tokens < 3:
            decode.step()
        pool.hold = True
        b = decode.add_request(PROMPTS[3], GREEDY, output_token_ids=first[1].output_token_ids)
        decode.step()
        assert pool.waiting.wait(30)
        before = a.num_output_tokens
        for _ in range(4):
            decode.step()
        assert a.num_output_tokens == before + 4  # a decodes while b's read is held up
        assert b.num_computed_tokens == 0 and id(b) in decode.scheduler.loading
        pool.gate.set()
        while decode.has_unfinished():
            decode.step()
        assert b.num_cached_tokens == len(PROMPTS[3])  # its whole prompt from the pool
        assert [a.output_token_ids, b.output_token_ids] == want[2:]
        assert decode.kv.num_free_blocks == decode.kv.num_blocks
    finally:
        pool.gate.set()
        decode.close()


def dp_tp_rank(dp_rank: int, world: int, address: str, model: str,
               shares: list[list[list[int]]], moves: list, shared_dp: bool) -> tuple:
    """DP rank ``dp_rank`` of 2, at TP 2, experts over all four ranks: its share of the
    prompts, stepped in lockstep with the other DP rank (over the engines' group); after
    ``moves[i][0]`` steps every rank moves MoE layer moves[i][1] to moves[i][2]."""
    torch.set_num_threads(1)

    from pdmesh.shared.engine.build import build_engine
    from pdmesh.shared.engine.config import EngineConfig

    eng = build_engine(EngineConfig(
        model=model, device="cpu", dtype="float32", block_size=16,
        data_parallel_size=world, data_parallel_rank=dp_rank, data_parallel_address=address,
        tensor_parallel_size=2, enable_expert_parallel=True,
        enable_shared_expert_dp=shared_dp))
    try:
        moe = eng.model.w.layers[eng.model.moe_layers[0]].mlp
        shapes = {"w13": list(eng.ep.w13[0].shape), "shared": None if moe.shared is None
                  else list(moe.shared.gate_up.shape)}
        reqs = [eng.add_request(p, GREEDY) for p in shares[dp_rank]]
        moved = 0
        for step in lockstep(eng, eng.dp_group):
            for at, layer, phy2log in moves:
                if at == step:
                    moved += eng.ep.move_experts(layer, torch.tensor(phy2log))
            eng.step()
        return [r.output_token_ids for r in reqs], moved, shapes
    finally:
        eng.close()


@pytest.mark.parametrize(("arch", "shared_dp"), [("qwen3_moe", False), ("deepseek_v3", False),
                                               ("deepseek_v3", True), ("deepseek_v4", True)])
def test_dp2_tp2_with_expert_parallelism_equals_one_process(tiny_models, arch, shared_dp):
    """Two DP ranks of two TP ranks each, the experts placed over all four (two slots
    each), an expert move half-way: every answer is the single-process engine's. With
    enable_shared_expert_dp the shared experts are whole on every rank (each runs them
    on its share of the tokens), split in two without."""

    path = str(tiny_models[arch])
    _, want = run(LLM(path, device="cpu", dtype="float32", block_size=16))
    moe = ModelConfig.from_folder(path).moe
    shares = [PROMPTS[0::2], PROMPTS[1::2]]
    swapped = list(range(moe.num_experts))[::-1]  # every expert changes rank
    moves = [(3, 0, swapped)]
    got = run_ranks(dp_tp_rank, 2, path, shares, moves, shared_dp, timeout_s=300)
    assert got[0][0] == want[0::2] and got[1][0] == want[1::2]
    assert got[0][1] > 0 and got[1][1] > 0  # the move crossed ranks
    # four expert-parallel ranks: a quarter of the experts each, at their full width
    full = moe.intermediate_size
    assert got[0][2]["w13"][0] == moe.num_experts // 4
    assert full * 2 in got[0][2]["w13"][1:]
    if arch != "qwen3_moe":
        shared_width = moe.intermediate_size * moe.num_shared_experts * 2
        assert got[0][2]["shared"][1] == (shared_width if shared_dp else shared_width // 2)


def fine_rank(dp_rank: int, world: int, address: str, model: str,
              shares: list[list[list[int]]], fine: dict, ep: bool,
              extra: dict | None = None) -> tuple:
    """DP rank ``dp_rank`` of 2 with ``fine`` (finegrained_tp_config), in lockstep: its
    outputs and the shapes of the weights fine-grained TP splits (``extra``: more of
    EngineConfig's fields)."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from pdmesh.shared.engine.build import build_engine
    from pdmesh.shared.engine.config import EngineConfig

    eng = build_engine(EngineConfig(
        model=model, device="cpu", dtype="float32", block_size=16,
        data_parallel_size=world, data_parallel_rank=dp_rank, data_parallel_address=address,
        enable_expert_parallel=ep, finegrained_tp_config=fine, **(extra or {})))
    shapes = split_shapes(eng.model)
    # rank 1 stops after 3 tokens and idles while rank 0 decodes (its empty forwards
    # make every collective of the split modules)
    params = GREEDY if dp_rank == 0 else SamplingParams(temperature=0, max_tokens=3,
                                                        ignore_eos=True)
    reqs = [eng.add_request(p, params) for p in shares[dp_rank]]
    with eng.runner.logits_kept() as kept:
        for _ in lockstep(eng):  # an idle rank still steps
            eng.step()
    dist.destroy_process_group()
    return [r.output_token_ids for r in reqs], shapes, kept[0].tolist()  # (plain: it pickles)


def split_shapes(model) -> dict[str, int]:
    """The sizes of what fine-grained TP splits: vocabulary rows of the embedding and
    the lm_head, input rows of o_proj, intermediate columns of a dense MLP's gate_up
    (DeepSeek-V4: of its grouped output projection's second half, wo_b; none for a model
    without a dense MLP)."""
    w = model.w
    if hasattr(w.layers[0].attn, "o_b"):
        return {"embedding": w.embed.shape[0], "lmhead": w.lm_head.shape[1],
                "oproj": _rows(w.layers[0].attn.o_b)}
    dense = next((lw.mlp for lw in w.layers if hasattr(lw.mlp, "gate_up")), None)
    return {"embedding": w.embed.shape[0], "lmhead": w.lm_head.shape[1],
            "oproj": _rows(w.layers[0].attn.o),
            **({} if dense is None else {"mlp": _columns(dense.gate_up)})}


def _rows(w) -> int:
    return (w.weight if hasattr(w, "weight") else w).shape[0]


def _columns(w) -> int:
    return (w.weight if hasattr(w, "weight") else w).shape[1]


def run_fine(path: str, fine: dict, ep: bool, shares, extra: dict | None = None) -> dict:
    return run_ranks(fine_rank, 2, path, shares, fine, ep, extra, timeout_s=300)


def check_fine(got: dict, want: list[list[int]], whole: dict[str, int], fine: dict) -> None:
    """Rank 0's answers are the first three, rank 1's the first 3 tokens of the fourth;
    each key halves its module on both ranks, the others are whole."""
    assert got[0][0] == want[:3] and got[1][0] == [w[:3] for w in want[3:]]
    for module, n in whole.items():
        split = f"{module}_tensor_parallel_size" in fine
        for rank in (0, 1):
            assert got[rank][1][module] == (-(-n // 2) if split else n), (module, rank)


ALL_FINE = {"embedding_tensor_parallel_size": 2, "lmhead_tensor_parallel_size": 2,
            "oproj_tensor_parallel_size": 2, "mlp_tensor_parallel_size": 2}
FINE = [("qwen3", {"embedding_tensor_parallel_size": 2}, False),
        ("qwen3", {"lmhead_tensor_parallel_size": 2}, False),
        ("qwen3", {"oproj_tensor_parallel_size": 2}, False),
        ("qwen3", {"mlp_tensor_parallel_size": 2}, False),
        ("deepseek_v3", ALL_FINE, True),
        ("deepseek_v4", ALL_FINE, True)]


@pytest.mark.parametrize(("arch", "fine", "ep"), FINE,
                         ids=["embedding", "lmhead", "oproj", "mlp", "deepseek-all-with-ep",
                              "deepseek-v4-all-with-ep"])
def test_each_finegrained_tp_key_splits_its_module_and_keeps_the_answers(tiny_models, arch,
                                                                         fine, ep):
    """Two DP ranks, the second stopping early (so it idles while the other works): each
    key halves its module's weights on both ranks (DeepSeek-V4: o_proj is its grouped
    output projection's second half, wo_b; it has no dense MLP), the answers are the
    single-process engine's."""
    path = str(tiny_models[arch])
    one = LLM(path, device="cpu", dtype="float32", block_size=16)
    _, want = run(one)
    got = run_fine(path, fine, ep, [PROMPTS[:3], PROMPTS[3:]])
    check_fine(got, want, split_shapes(one.engine.model), fine)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "deepseek_v4"])
def test_sglang_dp_attention_answers_as_one_process(tiny_models, arch):
    """SGLang's --tp-size 2 --dp-size 2 --enable-dp-attention, as every command reads it:
    two DP ranks of one TP rank each in lockstep, the experts over both, the LM head
    (and DeepSeek-V3's dense MLP) split over both; the greedy answers are the
    single-process engine's, the second rank idling while the first works."""
    from pdmesh.shared.config.serve import serve_config

    path = str(tiny_models[arch])
    engine = serve_config("mixed", [path, "--device", "cpu", "--tp-size", "2", "--dp-size",
                                    "2", "--enable-dp-attention"]).engine
    assert (engine.data_parallel_size, engine.tensor_parallel_size,
            engine.enable_expert_parallel) == (2, 1, True)
    fine = engine.finegrained_tp_config
    assert fine == {"lmhead_tensor_parallel_size": 2, "mlp_tensor_parallel_size": 2}
    one = LLM(path, device="cpu", dtype="float32", block_size=16)
    _, want = run(one)
    got = run_fine(path, fine, True, [PROMPTS[:3], PROMPTS[3:]])
    whole = split_shapes(one.engine.model)
    if "mlp" not in whole:  # (every layer MoE: the mlp key splits nothing)
        fine = {k: v for k, v in fine.items() if not k.startswith("mlp")}
    check_fine(got, want, whole, fine)


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v4"])
def test_finegrained_tp_splits_w8a8_dynamic_weights_with_their_scales(tiny_models, tmp_path,
                                                                      arch):
    """The seeds' line: W8A8_DYNAMIC weights (DeepSeek-V4's with expert parallelism), every
    module split. o_proj's halves quantize their half of an activation row each, so the
    first step's logits agree with one process's up to that (cosine), and so does each
    prompt's first token (but where one process's top two are closer than that
    difference); the weights are int8 on both ranks."""
    from pdmesh.shared.cli.quantize import quantize_checkpoint
    from pdmesh.shared.kernels.quant import QuantLinear

    out = tmp_path / "w8a8_dynamic"
    quantize_checkpoint(tiny_models[arch], out, "w8a8_dynamic")
    one = LLM(str(out), device="cpu", dtype="float32", block_size=16, quantization="ascend")
    logits, want = run(one)
    attn = one.engine.model.w.layers[0].attn
    assert isinstance(attn.o_b if arch == "deepseek_v4" else attn.o, QuantLinear)
    got = run_fine(str(out), ALL_FINE, arch == "deepseek_v4", [PROMPTS[:3], PROMPTS[3:]],
                   {"quantization": "ascend"})
    whole = split_shapes(one.engine.model)
    for rank, rows in ((0, slice(0, 3)), (1, slice(3, 4))):
        first = torch.tensor(got[rank][2])  # the prefill's logits: one process's inputs
        cos = torch.nn.functional.cosine_similarity(first.double(), logits[0][rows].double(),
                                                    dim=-1)
        assert float(cos.min()) > 0.99, (rank, cos)
        # each prompt's first token is one process's, or in a near tie there: logits that
        # differ by at most err can swap two tokens whose logits are within 2 err
        ref = logits[0][rows].double()
        err = (first.double() - ref).abs().amax(dim=-1)
        for row, (g, w) in enumerate(zip([t[0] for t in got[rank][0]],
                                         [t[0] for t in want[rows]], strict=True)):
            gap = float(ref[row].max() - ref[row][g])
            assert g == w or gap <= 2 * float(err[row]), (rank, row, g, w, gap, err[row])
        assert got[rank][1]["oproj"] == whole["oproj"] // 2


def test_finegrained_tp_refuses_static_w8a8_split_by_its_input(tiny_models, tmp_path):
    """At load, before any weight is read or any rank joined (each DP rank loads its
    slices as this does)."""
    from pdmesh.shared.cli.quantize import quantize_checkpoint
    from pdmesh.shared.kernels import get_backend
    from pdmesh.shared.models.loader import load_model
    from pdmesh.shared.parallel.finegrained_tp import FineGrainedLayout

    out = tmp_path / "w8a8"
    quantize_checkpoint(tiny_models["qwen3"], out, "w8a8")
    for key in ("oproj", "mlp"):
        fine = FineGrainedLayout.from_config({f"{key}_tensor_parallel_size": 2}, 0, 2)
        with pytest.raises(ValueError, match=rf"finegrained_tp_config\.{key}_tensor_parallel_"
                                             r"size: static W8A8 weights split by their input"):
            load_model(out, get_backend("cpu"), torch.float32, quantization_flag="ascend",
                       fine=fine)
    # embedding and lm_head are split by vocabulary rows: static W8A8 loads
    fine = FineGrainedLayout.from_config({"embedding_tensor_parallel_size": 2}, 0, 2)
    load_model(out, get_backend("cpu"), torch.float32, quantization_flag="ascend", fine=fine)


@pytest.mark.parametrize(("arch", "scheme"), [("qwen3", "w8a8_dynamic"),
                                              ("qwen3_moe", "w4a8_dynamic"),
                                              ("deepseek_v3", "fp8_block")])
def test_quantized_weights_split_with_their_scales(tiny_models, tmp_path, arch, scheme):
    """Each rank reads its rows (column-parallel: with their scales) or columns
    (row-parallel: the scales whole) of the quantized weights and computes them with
    the int8 kernels: the logits agree with TP1's on the same checkpoint up to what
    quantizing each rank's half of an activation row on its own changes."""
    from pdmesh.shared.cli.quantize import quantize_checkpoint
    from pdmesh.shared.kernels.quant import QuantLinear

    out = tmp_path / scheme
    quantize_checkpoint(tiny_models[arch], out, scheme)
    quant = None if scheme == "fp8_block" else "ascend"
    one = LLM(str(out), device="cpu", dtype="float32", block_size=16, quantization=quant)
    want, want_out = run(one)
    tp = LLM(str(out), device="cpu", dtype="float32", block_size=16, quantization=quant,
             tensor_parallel_size=2)
    try:
        o_one, o_tp = one.engine.model.w.layers[0].attn.o, tp.engine.model.w.layers[0].attn.o
        if scheme != "fp8_block":  # (FP8 runs dequantized on cpu)
            assert isinstance(o_tp, QuantLinear) and isinstance(o_one, QuantLinear)
            assert o_tp.weight.shape[0] * 2 == o_one.weight.shape[0]  # its input rows
        got, got_out = run(tp)
    finally:
        tp.close()
    cos = torch.nn.functional.cosine_similarity(got[0].double(), want[0].double(), dim=-1)
    assert float(cos.min()) > 0.999, float(cos.min())
    agree = sum(a == b for x, y in zip(got_out, want_out, strict=True)
                for a, b in zip(x, y, strict=True))
    assert agree >= 0.8 * sum(len(x) for x in want_out)


def test_static_w8a8_split_by_its_input_is_refused(tiny_models, tmp_path):
    from pdmesh.shared.cli.quantize import quantize_checkpoint

    out = tmp_path / "w8a8"
    quantize_checkpoint(tiny_models["qwen3"], out, "w8a8")
    with pytest.raises(ValueError, match=r"tensor_parallel_size: static W8A8 weights split by "
                                         r"their input \(model\.layers\.\d+\.\S+, \.\.\.\)"):
        LLM(str(out), device="cpu", quantization="ascend", tensor_parallel_size=2)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v4"])
def test_expert_parallelism_over_the_tensor_parallel_ranks_of_one_dp_rank(tiny_models, arch,
                                                                          tmp_path):
    """The features seed's line (--enable-expert-parallel, DP 1, TP > 1): the experts are
    spread over the TP ranks (each holds half of them, at full width) instead of split by
    width; `pdmesh serve` keeps the flag and EPLB's fields, the answers are one
    process's. On one rank it is said to be without effect, with EPLB's fields set."""
    from pdmesh.shared.config.serve import serve_config

    path = str(tiny_models[arch])
    eplb = '{"eplb_config": {"num_redundant_experts": 2}}'
    serve = serve_config("serve", [path, "--tensor-parallel-size", "2",
                                   "--enable-expert-parallel", "--additional-config", eplb],
                         env={}, device="cpu")
    assert serve.engine.enable_expert_parallel and serve.engine.num_redundant_experts == 2
    one_rank = serve_config("serve", [path, "--enable-expert-parallel",
                                      "--additional-config", eplb], env={}, device="cpu")
    assert not one_rank.engine.enable_expert_parallel
    said = " ".join(one_rank.warnings)
    assert "--enable-expert-parallel: without effect" in said
    assert "eplb_config.num_redundant_experts: without effect" in said
    _, want = run(LLM(path, device="cpu", dtype="float32", block_size=16))
    tp = LLM(path, device="cpu", dtype="float32", block_size=16, tensor_parallel_size=2,
             enable_expert_parallel=True)
    try:
        ep = tp.engine.ep
        moe = ModelConfig.from_folder(path).moe
        assert ep is not None and ep.world == 2 and ep.num_slots == moe.num_experts
        _, got = run(tp)
    finally:
        tp.close()
    assert got == want
