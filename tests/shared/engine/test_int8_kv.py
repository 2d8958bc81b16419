"""--kv-cache-dtype int8: K and V (MLA: the latent) kept per token and head in int8 with
a float32 scale beside them in the same blocks. The model computes what it computes with
a float cache, within int8's rounding; the cache and the pool take about half of
bfloat16's bytes; prefix caching, preemption and the pool hand-off keep working."""

from __future__ import annotations

import pytest
import torch

from pdmesh.shared.engine import LLM, EngineConfig, SamplingParams, build_engine
from pdmesh.shared.kvpool import InProcessPool

PROMPTS = [list(range(40, 75)), [5, 9, 200, 14], list(range(300, 345)), [77] * 20]
NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def step_logits(llm: LLM, prompts, params) -> list[torch.Tensor]:
    with llm.engine.runner.logits_kept() as kept:
        outs = llm.generate(prompts, params)
    return kept, [o.outputs[0].token_ids for o in outs]


# least first-token cosine with the float cache's logits. The tiny random DeepSeek-V4
# amplifies any rounding through its hyper-connections (bfloat16 instead of float32
# gives 0.994 there, 0.9999 on the others); int8 K=V, per token, rounds 4x coarser.
COSINE = {"deepseek_v4": 0.95}
ROLES = {"qwen3": ("k", "v"), "llama": ("k", "v"), "qwen3_moe": ("k", "v"),
         "deepseek_v3": ("latent",), "deepseek_v4": ("window", "entries", "index_keys")}


@pytest.mark.parametrize("arch", list(ROLES))
def test_int8_cache_tracks_the_float_cache(tiny_models, arch, record_property):
    path = str(tiny_models[arch])
    ref = LLM(path, device="cpu", dtype="float32", block_size=16)
    q8 = LLM(path, device="cpu", dtype="float32", block_size=16, kv_cache_dtype="int8")
    seen = set()
    for caches in q8.engine.runner.kv_caches:
        for role, t in caches.items():
            seen.add(role)
            if role.endswith("_scale"):
                assert t.dtype == torch.float32 and t.shape[-1] == 1, role
            elif role in ROLES[arch]:
                assert t.dtype == torch.int8, role
            else:  # DeepSeek-V4's compressor inputs stay float32
                assert role in ("state", "index_state") and t.dtype == torch.float32
    assert {r + "_scale" for r in ROLES[arch]} <= seen
    # the same teacher-forced steps: prefill, then decode over the cache
    forced = [p + list(range(900, 900 + NEW)) for p in PROMPTS]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    want, _ = step_logits(ref, forced, one)
    got, _ = step_logits(q8, forced, one)
    cos = torch.nn.functional.cosine_similarity(got[0].double(), want[0].double(), dim=-1)
    assert float(cos.min()) >= COSINE.get(arch, 0.999), cos
    # decoding reads the int8 cache at every step
    _, a = step_logits(ref, PROMPTS, GREEDY)
    logits, b = step_logits(q8, PROMPTS, GREEDY)
    assert len(logits) >= NEW
    record_property("greedy_agreement", sum(x == y for s, t in zip(a, b, strict=True)
                                            for x, y in zip(s, t, strict=True)))


def test_int8_cache_takes_about_half_of_bfloat16(tiny_models):
    path = str(tiny_models["qwen3"])
    bf16 = build_engine(EngineConfig(model=path, device="cpu", dtype="bfloat16", block_size=16,
                                     num_kv_blocks=64))
    q8 = build_engine(EngineConfig(model=path, device="cpu", dtype="bfloat16", block_size=16,
                                   num_kv_blocks=64, kv_cache_dtype="int8"))
    d = q8.model_config.head_dim
    # per head and token: d int8 bytes and one float32 scale, against 2 d bytes
    assert q8.kv_bytes_per_token / bf16.kv_bytes_per_token == pytest.approx((d + 4) / (2 * d))
    assert q8.kv_fingerprint != bf16.kv_fingerprint  # blocks of the two never mix


def test_prefix_hits_and_preemption_keep_the_int8_answers(tiny_models):
    path = str(tiny_models["qwen3"])
    plain = LLM(path, device="cpu", dtype="float32", block_size=16, kv_cache_dtype="int8",
                enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    cached = LLM(path, device="cpu", dtype="float32", block_size=16, kv_cache_dtype="int8")
    cached.generate(PROMPTS[:1], GREEDY)
    outs = cached.generate(PROMPTS, GREEDY)
    assert outs[0].num_cached_tokens > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    # too few blocks for all four to grow: requests are preempted and recomputed
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, long)]
    tight = LLM(path, device="cpu", dtype="float32", block_size=16, kv_cache_dtype="int8",
                num_kv_blocks=10, enable_prefix_caching=False)
    outs = tight.generate(PROMPTS, long)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert tight.engine.scheduler.preemptions > 0


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_prefill_then_decode_through_the_pool_in_int8(tiny_models, arch):
    """MLA's latent; DeepSeek-V4's compressed history and its window's tail: int8 with
    their scales through the pool, the decode instance continuing exactly."""
    path = str(tiny_models[arch])
    config = EngineConfig(model=path, device="cpu", dtype="float32", block_size=16,
                          kv_cache_dtype="int8")
    want = [o.outputs[0].token_ids for o in LLM(
        path, device="cpu", dtype="float32", block_size=16, kv_cache_dtype="int8").generate(
        PROMPTS, GREEDY)]
    pool = InProcessPool()
    prefill = build_engine(config, kv_pool=pool, save_prompts=True)
    decode = build_engine(config, kv_pool=pool, save_prompts=False)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    pre = [prefill.add_request(p, first) for p in PROMPTS]
    while prefill.has_unfinished():
        prefill.step()
    dec = [decode.add_request(p, GREEDY, output_token_ids=r.output_token_ids)
           for p, r in zip(PROMPTS, pre, strict=True)]
    while decode.has_unfinished():
        decode.step()
    assert [r.output_token_ids for r in dec] == want
    assert [r.num_cached_tokens for r in dec] == [len(p) for p in PROMPTS]


def test_other_kv_cache_dtypes_are_refused(tiny_models):
    with pytest.raises(ValueError, match=r"kv_cache_dtype: .* not 'fp8'"):
        LLM(str(tiny_models["qwen3"]), device="cpu", kv_cache_dtype="fp8")


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_mtp_drafts_over_an_int8_cache(tiny_models, arch):
    """The MTP layer's KV sits in the same int8 blocks: drafting keeps the greedy output."""
    path = str(tiny_models[arch])
    plain = LLM(path, device="cpu", dtype="float32", block_size=16, kv_cache_dtype="int8")
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    mtp = LLM(path, device="cpu", dtype="float32", block_size=16, kv_cache_dtype="int8",
              speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2,
                                  "adaptive_drafts": False})
    role = "latent" if arch == "deepseek_v3" else "window"
    assert mtp.engine.proposer.caches[0][role].dtype == torch.int8
    assert [o.outputs[0].token_ids for o in mtp.generate(PROMPTS, GREEDY)] == want
    assert mtp.engine.spec_stats.num_drafts > 0
