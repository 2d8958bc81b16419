"""Speculative decoding (n-gram drafts): greedy output token-identical to decoding one
token a step, under chunked prefill, preemption and prefix caching; the verifier keeps
the target's distribution (and a lossy one would not); no KV block leaked."""

from __future__ import annotations

import random

import pytest
import torch

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.engine.spec_decode import (
    Drafts,
    NgramProposer,
    SpecStats,
    SpeculativeConfig,
    verify,
)
from tests.shared.engine.spec_runs import assert_hand_back_exact, assert_no_block_held, run


def ngram(k: int, lo: int = 1, hi: int = 4) -> dict:
    """(Every step drafts k: these tests are of drafting and verifying, not of how many
    drafts pay - test_draft_length.py.)"""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo,
            "prompt_lookup_max": hi, "adaptive_drafts": False}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Repetitive prompts (the drafts get accepted) and plain random ones, mixed lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append([rng.randrange(10, 900) for _ in range(rng.randrange(4, 60))])
        else:
            motif = [rng.randrange(10, 900) for _ in range(rng.randrange(2, 9))]
            out.append((motif * 40)[:rng.randrange(8, 150)])
    return out


@pytest.fixture(scope="module")
def greedy_reference(qwen3_path):
    ps = prompts(18)
    params = [SamplingParams(temperature=0, max_tokens=24 + 5 * (i % 4), ignore_eos=True)
              for i in range(len(ps))]
    return ps, params, run(qwen3_path, ps, params)[0]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_is_token_identical(qwen3_path, greedy_reference, k):
    ps, params, want = greedy_reference
    got, llm = run(qwen3_path, ps, params, speculative_config=ngram(k))
    assert got == want
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert len(stats.accepted_per_position) <= k
    assert_no_block_held(llm)


def test_identical_under_chunked_prefill_and_preemption(qwen3_path, greedy_reference):
    """A small step budget (prompts in chunks, drafts cut to the budget) and a cache so
    small that requests are preempted and recomputed."""
    ps, params, want = greedy_reference
    got, llm = run(qwen3_path, ps, params, speculative_config=ngram(3),
                   max_num_batched_tokens=24, num_kv_blocks=24)
    assert got == want
    assert llm.engine.scheduler.preemptions > 0
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert_no_block_held(llm)


def test_prefix_cache_holds_only_verified_tokens(qwen3_path):
    """Blocks filled while drafts were verified are found again by a prompt that extends
    the first request with its output, and give the same continuation as no cache."""
    ps = prompts(6, seed=3)
    first = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(str(qwen3_path), device="cpu", block_size=16, speculative_config=ngram(3))
    outs = [o.outputs[0].token_ids for o in llm.generate(ps, first)]
    longer = [p + o for p, o in zip(ps, outs, strict=True)]
    then = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    hits_before = llm.engine.scheduler.prefix_hits
    got = [o.outputs[0].token_ids for o in llm.generate(longer, then)]
    assert llm.engine.scheduler.prefix_hits - hits_before >= 16 * len(longer)
    want = run(qwen3_path, longer, then, enable_prefix_caching=False)[0]
    assert got == want
    assert_no_block_held(llm)


def test_stops_inside_the_drafts_cut_the_output(qwen3_path, greedy_reference):
    """A stop token or max_tokens reached among the kept drafts ends the request there."""
    ps, _, _ = greedy_reference
    free_run = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    base = run(qwen3_path, ps, free_run)[0]
    params = [SamplingParams(temperature=0, max_tokens=7 + i % 5, ignore_eos=True,
                             stop_token_ids=[out[10]]) for i, out in enumerate(base)]
    want = run(qwen3_path, ps, params)[0]
    got, llm = run(qwen3_path, ps, params, speculative_config=ngram(4))
    assert got == want
    for out, p in zip(got, params, strict=True):
        assert len(out) <= p.max_tokens
    assert_no_block_held(llm)


def test_penalties_and_logprobs_decode_one_token_a_step(qwen3_path):
    """Requests the verifier could not reproduce exactly get no drafts, and their output
    is the same as without speculation."""
    ps = prompts(5, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                             repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                             bad_words_token_ids=[[ps[4][1]], ps[4][2:4]]),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                             presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=20)]
    want = run(qwen3_path, ps, params)[0]
    got, llm = run(qwen3_path, ps, params, speculative_config=ngram(3))
    assert got == want
    assert llm.engine.spec_stats.num_drafts == 0


def test_seeded_sampling_repeats_and_drafts_are_accepted(qwen3_path):
    ps = prompts(6, seed=7)
    params = SamplingParams(temperature=0.1, top_p=0.9, seed=11, max_tokens=30,
                            ignore_eos=True)
    a, llm = run(qwen3_path, ps, params, speculative_config=ngram(3))
    b = run(qwen3_path, ps, params, speculative_config=ngram(3))[0]
    assert a == b
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert_no_block_held(llm)


# -- the verifier ----------------------------------------------------------------------
V = 6
SAMPLES = 20000
CHI2_DF5_P001 = 20.52  # chi-square critical value, 5 degrees of freedom, p = 0.001


def chi_square(counts: list[int], p: torch.Tensor) -> float:
    expected = p * sum(counts)
    return float(((torch.tensor(counts, dtype=torch.float64) - expected) ** 2
                  / expected).sum())


def first_tokens(p: torch.Tensor, draw_drafts, lossy: bool = False) -> list[int]:
    counts = [0] * V
    probs = torch.stack([p, p])  # the drafted position and the one after it
    argmax = probs.argmax(dim=-1)
    for _ in range(SAMPLES):
        drafts = draw_drafts()
        if lossy:  # accept the draft whatever the target says
            token = drafts.tokens[0]
        else:
            token = verify(probs, argmax, drafts, False, lambda j: None)[0]
        counts[token] += 1
    return counts


def test_the_verifier_keeps_the_target_distribution():
    torch.manual_seed(0)
    p = torch.softmax(torch.tensor([1.5, 0.2, -0.7, 0.9, 0.0, -1.6], dtype=torch.float64), 0)
    # an n-gram draft: a point mass on one token (here a likely one, then an unlikely one)
    for x in (0, 5):
        counts = first_tokens(p, lambda x=x: Drafts([x]))
        assert chi_square(counts, p) < CHI2_DF5_P001, (x, counts)
    # a draft drawn from its own distribution q (as a draft model proposes)
    q = torch.softmax(torch.tensor([-1.0, 1.0, 0.5, -0.5, 1.2, 0.3], dtype=torch.float64), 0)

    def from_q() -> Drafts:
        return Drafts([int(torch.multinomial(q, 1))], q.unsqueeze(0))

    counts = first_tokens(p, from_q)
    assert chi_square(counts, p) < CHI2_DF5_P001, counts
    # the test can tell: keeping every draft gives q's distribution, not p's
    assert chi_square(first_tokens(p, from_q, lossy=True), p) > 10 * CHI2_DF5_P001


def test_greedy_verification_keeps_the_matching_prefix():
    argmax = torch.tensor([4, 7, 2, 9])
    assert verify(None, argmax, Drafts([4, 7, 2]), True, lambda j: None) == [4, 7, 2, 9]
    assert verify(None, argmax, Drafts([4, 1, 2]), True, lambda j: None) == [4, 7]
    assert verify(None, argmax, Drafts([3, 7, 2]), True, lambda j: None) == [4]


def test_ngram_lookup_takes_the_longest_suffix_latest_occurrence():
    lookup = NgramProposer(1, 3).lookup
    assert lookup([1, 2, 3, 9, 1, 2, 3, 5, 1, 2, 3], 2) == [5, 1]  # latest "1 2 3"
    assert lookup([7, 8, 1, 2, 6, 6, 2], 3) == [6, 6, 2]  # only "2" recurs
    assert lookup([1, 2, 3, 4], 3) == []
    assert NgramProposer(2, 3).lookup([5, 1, 9, 1], 2) == []  # "1" alone is too short


def test_speculative_config_as_vllm_reads_it():
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2}) \
        == SpeculativeConfig("ngram", 2, 5, 5)
    assert SpeculativeConfig.from_dict({"method": "[ngram]", "num_speculative_tokens": 2,
                                        "prompt_lookup_max": 3}).prompt_lookup_min == 3
    for raw, key in (({"method": "ngram", "num_speculative_tokens": 0},
                      "num_speculative_tokens"),
                     ({"method": "ngram", "num_speculative_tokens": 2,
                       "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                     ({"method": "eagle", "num_speculative_tokens": 1}, "method"),
                     ({"method": "ngram", "num_speculative_tokens": 1,
                       "enforce_eagr": True}, "enforce_eagr: unknown key; did you mean"),
                     ({"method": "ngram", "num_speculative_tokens": 1,
                       "disable_by_batch_size": 0}, "disable_by_batch_size")):
        with pytest.raises(ValueError, match=f"speculative_config.{key}"):
            SpeculativeConfig.from_dict(raw)


def test_keys_pdmesh_does_not_act_on_are_named():
    raw = {"method": "ngram", "num_speculative_tokens": 1, "enforce_eager": True,
           "model": None}
    assert SpeculativeConfig.from_dict(raw).num_speculative_tokens == 1
    assert SpeculativeConfig.inactive_keys(raw) == ["enforce_eager", "model"]


def test_no_drafts_while_the_batch_is_larger_than_disable_by_batch_size(qwen3_path,
                                                                      greedy_reference):
    ps, params, want = greedy_reference
    got, llm = run(qwen3_path, ps, params,
                   speculative_config={**ngram(3), "disable_by_batch_size": 4})
    assert got == want
    drafted_alone, llm_alone = run(qwen3_path, ps[:1], params[:1],
                                   speculative_config={**ngram(3), "disable_by_batch_size": 4})
    assert llm_alone.engine.spec_stats.num_drafts > 0 and drafted_alone == want[:1]
    # 18 requests at once: drafts only once fewer than 5 are left
    full = run(qwen3_path, ps, params, speculative_config=ngram(3))[1]
    assert 0 < llm.engine.spec_stats.num_drafts < full.engine.spec_stats.num_drafts


def test_stats_count_as_vllm_does():
    stats = SpecStats()
    stats.record(3, 2)
    stats.record(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)
    assert stats.accepted_per_position == [1, 1, 0]
    assert stats.acceptance_rate == pytest.approx(0.4)


def test_drafts_stay_with_their_request_when_an_earlier_one_is_preempted():
    """SGLang's priority preemption withdraws a victim scheduled earlier in the step; the
    drafts of the requests after it still belong to them."""
    from pdmesh.shared.engine.block_manager import KVCacheManager
    from pdmesh.shared.engine.policy import PriorityPolicy
    from pdmesh.shared.engine.request import Request
    from pdmesh.shared.engine.scheduler import Scheduler

    s = Scheduler(KVCacheManager(64, 4, enable_prefix_caching=True),
                  PriorityPolicy(low_values_first=True, preemption_threshold=10), 2, 64, 512)
    lo = Request("lo", [100, 101, 102], SamplingParams(max_tokens=20), priority=50)
    mid = Request("mid", [200, 201, 202], SamplingParams(max_tokens=20), priority=5)
    for r in (lo, mid):
        s.add(r)
    out = s.schedule()
    s.update(out, {0: 7, 1: 8})
    lo.drafts, mid.drafts = Drafts([7, 7]), Drafts([8, 9, 8])
    s.add(Request("hi", [300, 301], SamplingParams(max_tokens=20), priority=0))
    out = s.schedule()
    assert out.preempted == [lo] and out.requests[0] is mid
    assert out.drafts == {mid: Drafts([8, 9, 8])}
    assert out.num_tokens[0] == 1 + 3


def scan(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Prompt lookup by brute force: the longest suffix, its latest earlier start."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
        if starts:
            return tokens[starts[-1] + n:starts[-1] + n + k]
    return []


def test_the_indexed_lookup_follows_the_tokens_as_they_grow():
    """Proposing step after step (the index growing with the tokens) gives what a lookup
    over the whole sequence gives, every time."""
    from pdmesh.shared.engine.request import Request

    rng = random.Random(1)
    proposer = NgramProposer(1, 4)
    for _ in range(20):
        req = Request("r", [rng.randrange(6) for _ in range(rng.randrange(1, 12))],
                      SamplingParams())
        for _ in range(40):
            assert proposer.propose([req], 3)[0].tokens == scan(req.token_ids, 3, 1, 4)
            for _ in range(rng.randrange(1, 4)):  # one token a step, or kept drafts
                req.append_token(rng.randrange(6))


# -- vLLM-Ascend's lossy verification (rejection_sampler_config) -------------------------
def first_tokens_with(p: torch.Tensor, d: int, thresholds=None, block=False) -> list[int]:
    """The first kept token's counts over SAMPLES verifications of d point-mass drafts of
    token 0, the target p at every position."""
    probs = torch.stack([p] * (d + 1))
    argmax = probs.argmax(dim=-1)
    counts = [0] * V
    for _ in range(SAMPLES):
        counts[verify(probs, argmax, Drafts([0] * d), False, lambda j: None, thresholds,
                      block)[0]] += 1
    return counts


P_LOSSY = torch.softmax(torch.tensor([0.9, 0.6, 0.1, -0.3, 0.4, -1.0], dtype=torch.float64), 0)


def test_entropy_verify_at_threshold_one_is_standard_and_below_it_accepts_more():
    torch.manual_seed(1)
    assert chi_square(first_tokens_with(P_LOSSY, 1, [1.0]), P_LOSSY) < CHI2_DF5_P001
    counts = first_tokens_with(P_LOSSY, 1, [0.5])
    # u * 0.5 <= p(0): the draft passes with probability min(1, p(0) / 0.5)
    assert counts[0] / SAMPLES == pytest.approx(min(1.0, float(P_LOSSY[0]) / 0.5), abs=0.02)
    assert chi_square(counts, P_LOSSY) > 10 * CHI2_DF5_P001  # lossy, as the seed says


def test_block_verify_keeps_a_prefix_that_a_later_position_vouches_for():
    """Block verify passes position k on the product of the ratios against the product
    of the draws: a first draft that fails alone is kept when the second passes, so the
    first token is the draft more often than p says - lossy."""
    torch.manual_seed(2)
    p0 = float(P_LOSSY[0])
    counts = first_tokens_with(P_LOSSY, 3, block=True)
    assert counts[0] / SAMPLES > p0 + 0.05
    assert chi_square(counts, P_LOSSY) > 10 * CHI2_DF5_P001
    # one position alone: the same test as standard verification
    one = [0] * V
    probs = torch.stack([P_LOSSY, P_LOSSY])
    for _ in range(SAMPLES):
        one[verify(probs, probs.argmax(-1), Drafts([0]), False, lambda j: None, None,
                   True)[0]] += 1
    assert chi_square(one, P_LOSSY) < CHI2_DF5_P001


def test_greedy_requests_ignore_the_lossy_options(qwen3_path, greedy_reference):
    argmax = torch.tensor([4, 7, 2, 9])
    assert verify(None, argmax, Drafts([4, 1, 2]), True, lambda j: None, [0.1] * 3,
                  True) == [4, 7]
    ps, params, want = greedy_reference
    lossy = SpeculativeConfig("ngram", 3, 1, 4, adaptive=False, enable_block_verify=True,
                              enable_entropy_verify=True, posterior_threshold=0.5)
    got, llm = run(qwen3_path, ps, params, speculative_config=lossy)
    assert got == want and llm.engine.spec_stats.num_accepted_tokens > 0


def test_lossy_sampling_accepts_more_drafts_in_the_engine(qwen3_path):
    ps = prompts(8, seed=9)
    params = SamplingParams(temperature=0.3, seed=3, max_tokens=40, ignore_eos=True)
    plain = run(qwen3_path, ps, params, speculative_config=ngram(3))[1].engine.spec_stats
    lossy = SpeculativeConfig("ngram", 3, 1, 4, adaptive=False, enable_block_verify=True,
                              enable_entropy_verify=True, posterior_threshold=0.3,
                              posterior_alpha=0.4)
    _, llm = run(qwen3_path, ps, params, speculative_config=lossy)
    assert llm.engine.spec_stats.acceptance_rate > plain.acceptance_rate
    assert_no_block_held(llm)


def test_the_engines_sampler_verifies_to_the_tempered_top_k_distribution():
    """Through the engine's Sampler (temperature and top-k applied to the target rows as
    when sampling one token): the first kept token follows that distribution."""
    from pdmesh.shared.engine.request import Request
    from pdmesh.shared.engine.sampler import Sampler
    from pdmesh.shared.kernels import get_backend

    torch.manual_seed(4)
    sampler = Sampler(get_backend("cpu"), V)
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.3, -1.0])
    params = SamplingParams(temperature=1.3, top_k=4, max_tokens=100)
    req = Request("r", [1, 2, 3], params)
    counts = [0] * V
    for _ in range(SAMPLES):
        counts[sampler.verify(torch.stack([row, row]), [req], [Drafts([1])])[0][0]] += 1
    kept = row.topk(4).indices
    target = torch.zeros(V, dtype=torch.float64)
    target[kept] = torch.softmax(row[kept].double() / 1.3, 0)
    outside = [t for t in range(V) if t not in kept.tolist()]
    assert all(counts[t] == 0 for t in outside)
    inside = kept.tolist()
    expected = target[inside] * SAMPLES
    got = torch.tensor([counts[t] for t in inside], dtype=torch.float64)
    assert float(((got - expected) ** 2 / expected).sum()) < 16.27  # df 3, p = 0.001


def test_recompute_hand_back_with_drafts_keeps_every_output_exact(qwen3_path,
                                                                  greedy_reference):
    """vLLM-Ascend's recompute scheduler on a decode engine that drafts: a request that
    must give its blocks up is handed back; whatever each request produced until then is
    the start of its greedy answer, and no block stays held."""
    ps, params, want = greedy_reference
    llm = LLM(str(qwen3_path), device="cpu", block_size=16, num_kv_blocks=20,
              recompute_scheduler=True, speculative_config=ngram(3))
    assert_hand_back_exact(llm, ps, params, want)
