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
from pdmesh.shared.models.config import ModelConfig
from pdmesh.shared.models.transformer import weight_bytes
from pdmesh.shared.parallel.tensor_parallel import Shard, TensorParallelRanks, local_config

PROMPTS = [list(range(40, 75)), [5, 9, 200, 14], list(range(300, 345)), [77] * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(llm: LLM) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The logits the engine sampled from at every step, and the outputs."""
    with llm.engine.runner.logits_kept() as kept:
        outs = llm.generate(PROMPTS, GREEDY)
    return kept, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe", "deepseek_v3"])
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
    with pytest.raises(ValueError, match=r"DeepSeek-V4 does not run tensor-parallel"):
        local_config(ModelConfig.from_folder(tiny_models["deepseek_v4"]), Shard(0, 2))


def test_tensor_parallel_beside_what_it_does_not_take_yet_is_refused(tiny_models):
    with pytest.raises(ValueError, match=r"tensor_parallel_size: not yet with data or "
                                         r"expert parallelism or speculative decoding"):
        LLM(str(tiny_models["qwen3"]), device="cpu", tensor_parallel_size=2,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_rank_memory_is_reported_at_start_up(tiny_models, caplog):
    path = str(tiny_models["qwen3"])
    one = LLM(path, device="cpu", dtype="float32", block_size=16, num_kv_blocks=64)
    whole = weight_bytes(one.engine.model.w)
    with caplog.at_level(logging.INFO, logger="pdmesh.shared.engine.engine"):
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


def failing_worker(config, rank, size, address, messages):
    """A worker whose shard cannot load (what a corrupt slice or a missing device does)."""
    from pdmesh.shared.parallel.tensor_parallel import report_failure

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


@pytest.mark.parametrize(("arch", "prefill_tp", "decode_tp"),
                         [("qwen3", 2, 1), ("qwen3", 1, 2), ("deepseek_v3", 2, 1)])
def test_prefill_and_decode_at_different_tp_sizes_share_the_pool(tiny_models, arch,
                                                                   prefill_tp, decode_tp):
    """A prefill engine at TP a puts whole blocks; a decode engine at TP b reads the heads
    it holds: decode computes no prompt token and answers as one engine does (MLA: the
    latent, the same on every rank)."""
    from pdmesh.shared.engine import EngineConfig, EngineCore
    from pdmesh.shared.kvpool import InProcessPool

    path = str(tiny_models[arch])
    want_logits, want = run(LLM(path, device="cpu", dtype="float32", block_size=16))
    pool = InProcessPool()

    def engine(tp: int, producer: bool) -> EngineCore:
        return EngineCore(EngineConfig(model=path, device="cpu", dtype="float32",
                                       block_size=16, tensor_parallel_size=tp),
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
