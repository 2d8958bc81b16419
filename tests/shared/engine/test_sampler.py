"""Sampler semantics on hand-made logits, and seeded reproducibility through the engine."""

from __future__ import annotations

import math

import pytest
import torch

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.engine.request import Request
from pdmesh.shared.engine.sampler import Sampler
from pdmesh.shared.kernels import get_backend

V = 12


def reqs(*params: SamplingParams, outputs: list[list[int]] | None = None) -> list[Request]:
    out = []
    for i, p in enumerate(params):
        r = Request(str(i), [1, 2, 3], p, eos_token_ids=(0,))
        for t in (outputs[i] if outputs else []):
            r.append_token(t)
        out.append(r)
    return out


@pytest.fixture
def sampler():
    return Sampler(get_backend("cpu"), V)


def test_greedy_and_top_k_one(sampler):
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    out = sampler(logits, reqs(SamplingParams(temperature=0), SamplingParams(top_k=1),
                               SamplingParams(temperature=0.7, top_k=1)))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_seed_dependent(sampler):
    logits = torch.zeros(1, V)  # uniform: every token equally likely
    def draw(seed):
        r = reqs(SamplingParams(temperature=1.0, seed=seed))
        out = []
        for _ in range(20):  # each draw at the next output position
            out.append(sampler(logits, r).token_ids[0])
            r[0].append_token(out[-1])
        return out
    assert draw(5) == draw(5)
    assert draw(5) != draw(6)
    assert len(set(draw(5))) > 3  # the position moves the draw


def test_top_p_and_min_p_restrict_support(sampler):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05] + [1e-9] * (V - 5)]))
    for p, allowed in ((SamplingParams(top_p=0.7, seed=1), {0, 1}),
                       (SamplingParams(min_p=0.5, seed=2), {0, 1}),
                       (SamplingParams(top_k=3, seed=3), {0, 1, 2})):
        r = reqs(p)
        got = set()
        for _ in range(200):
            got.add(sampler(logits, r).token_ids[0])
            r[0].append_token(7)  # the next output position: a fresh draw
        assert got == allowed, (p, got)


def test_min_tokens_masks_eos_and_stop_ids(sampler):
    logits = torch.full((1, V), -10.0)
    logits[0, 0] = 10.0  # eos is by far the likeliest
    logits[0, 5] = 9.0  # then a stop id
    r = reqs(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5]))
    assert sampler(logits, r).token_ids == [logits[0, 1:5].argmax().item() + 1]
    done = reqs(SamplingParams(temperature=0, min_tokens=3), outputs=[[7, 7, 7]])
    assert sampler(logits, done).token_ids == [0]


def test_penalties_follow_vllm_definitions(sampler):
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.9] + [-5.0] * (V - 4)])
    # repetition: prompt tokens 1,2,3 are "seen"; positive logits divided, negative multiplied
    r = reqs(SamplingParams(temperature=0, repetition_penalty=2.0))
    pen = sampler._apply_penalties(logits, r)
    assert pen[0, :4].tolist() == pytest.approx([2.0, -2.0, 0.25, 0.95])
    # frequency / presence count output tokens only
    r = reqs(SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25),
             outputs=[[0, 0, 3]])
    pen = sampler._apply_penalties(logits, r)
    assert pen[0, 0].item() == pytest.approx(2.0 - 2 * 0.5 - 0.25)
    assert pen[0, 3].item() == pytest.approx(1.9 - 0.5 - 0.25)
    assert pen[0, 1].item() == -1.0
    # and they change the greedy choice: token 0 was the argmax
    assert sampler(logits, r).token_ids == [3]  # 0.75 vs 1.15 vs 0.5


def test_logprobs_are_raw_and_ranked(sampler):
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(4))
    out = sampler(logits, reqs(SamplingParams(temperature=0, logprobs=3),
                               SamplingParams(temperature=0)))
    ref = torch.log_softmax(logits[0], -1)
    lp = out.logprobs[0]
    assert out.logprobs[1] is None
    top3 = ref.topk(3).indices.tolist()
    assert set(lp) == set(top3)
    for tid, entry in lp.items():
        assert math.isclose(entry.logprob, ref[tid].item(), rel_tol=1e-5)
    assert lp[out.token_ids[0]].rank == 1


def test_bad_words_ban_a_last_token_after_its_prefix(sampler):
    """vLLM's rule: a one-token word is banned at every step; a longer word's last token
    only where the output (not the prompt: it ends with 3 here) ends with the rest."""
    logits = torch.arange(V, dtype=torch.float32).repeat(4, 1)  # 11 likeliest, then 10...
    words = [[11], [7, 10], [3, 10], [4, 5, 10]]
    p = SamplingParams(temperature=0, bad_words_token_ids=words)
    out = sampler(logits, reqs(p, p, p, p, outputs=[[], [7], [4, 5], [9, 5]]))
    # row 0: 11 banned -> 10 (the prompt's 3 does not count); rows 1, 2: after 7, after
    # 4 5, 10 too -> 9; row 3: 5 without the 4 before it bans nothing more -> 10
    assert out.token_ids == [10, 9, 9, 10]
    only = sampler(logits[:1], reqs(SamplingParams(temperature=0, bad_words_token_ids=[
        [t] for t in range(5, V)]), outputs=[[1]]))
    assert only.token_ids == [4]
    lp = sampler(logits[:1], reqs(SamplingParams(temperature=0, logprobs=1,
                                                 bad_words_token_ids=[[11]])))
    assert lp.token_ids == [10] and lp.logprobs[0][11].rank == 1  # logprobs stay raw


def test_engine_bad_words_leave_a_greedy_answer_clear_of_them(qwen3_path):
    llm = LLM(str(qwen3_path), device="cpu", block_size=16)
    prompt = [40, 41, 42, 43]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                  ignore_eos=True))[0].outputs[0].token_ids
    pair = plain[3:5]  # a two-token word the plain answer holds
    banned = llm.generate([prompt], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True,
        bad_words_token_ids=[pair, [plain[0]]]))[0].outputs[0].token_ids
    assert banned[0] != plain[0] and plain[0] not in banned
    assert all(banned[i:i + 2] != pair for i in range(len(banned) - 1)), (pair, banned)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_engine_seeded_sampling_reproducible_across_batches(qwen3_path):
    llm = LLM(str(qwen3_path), device="cpu", block_size=16)
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16)
    alone = llm.generate("def main():", p)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=16)
    batched = llm.generate(["import sys", "def main():", "class A:"], [other, p, other])
    assert batched[1].outputs[0].token_ids == alone
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("cut", [1, 5, 11])
def test_a_seeded_request_continued_elsewhere_draws_the_same(qwen3_path, cut):
    """A seeded request's draw at each output position depends on the seed and the
    position only: one engine generating ``cut`` tokens and another continuing from them
    (a decode instance after prefill, or after a failover) gives the tokens one engine
    alone gives."""
    llm = LLM(str(qwen3_path), device="cpu", block_size=16)
    p = SamplingParams(temperature=1.0, seed=77, max_tokens=16, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 10]
    alone = llm.generate([prompt], p)[0].outputs[0].token_ids
    first = SamplingParams(temperature=1.0, seed=77, max_tokens=cut, ignore_eos=True)
    head = llm.generate([prompt], first)[0].outputs[0].token_ids
    assert head == alone[:cut]
    other = LLM(str(qwen3_path), device="cpu", block_size=16)
    req = other.engine.add_request(prompt, p, output_token_ids=head)
    while other.engine.has_unfinished():
        other.engine.step()
    assert list(req.output_token_ids) == alone
    unseeded = SamplingParams(temperature=1.0, seed=78, max_tokens=16, ignore_eos=True)
    assert llm.generate([prompt], unseeded)[0].outputs[0].token_ids != alone
