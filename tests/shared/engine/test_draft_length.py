"""How many drafts a step verifies (``DraftLength``): the configured count until step
times and acceptance are measured; then as many as give the most tokens per second -
all of them when a step costs the same whatever its rows, none when steps are
compute-bound and the drafts mostly rejected (the proposer's own time counted); a step
without drafts is measured once if it never was; it follows the acceptance as it
changes and asks again for lengths not measured lately. In the engine: a step that drafts
nothing leaves the output unchanged, skips the MTP layer, and holds no block."""

from __future__ import annotations

import random

import pytest

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.engine.draft_length import MIN_ASKED, DraftLength
from pdmesh.shared.engine.spec_decode import SpeculativeConfig
from tests.shared.engine.spec_runs import assert_no_block_held, run


def measured(k: int, seconds_of, accept: list[float], n: int = 32, steps: int = 300,
             seed: int = 0, into: DraftLength | None = None) -> DraftLength:
    """A DraftLength that saw steps of 1 .. 256 rows take ``seconds_of(rows)``, and
    ``steps`` verifications of k drafts for n requests, draft j accepted (after the
    ones before it) with probability ``accept[j]``."""
    rng = random.Random(seed)
    dl = into or DraftLength(k)
    for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        for _ in range(3):
            dl.record_step(rows, seconds_of(rows))
    for _ in range(steps):
        dl.record_asked(n, k)
        for _ in range(n):
            kept = 0
            while kept < k and rng.random() < accept[kept]:
                kept += 1
            dl.record_verified(k, kept)
    return dl


def compute_bound(rows: float) -> float:
    return 1e-3 + 1e-4 * rows  # 0.1 ms a row over a 1 ms step


def test_until_measured_it_drafts_what_was_configured():
    dl = DraftLength(3)
    assert dl.choose(64, 0) == 3
    for _ in range(10):
        dl.record_step(64, 0.05)  # one row count only: no slope to read
    dl.record_asked(64, 3)
    for _ in range(64):
        dl.record_verified(3, 0)
    assert dl.seconds_at(100) is None and dl.choose(64, 0) == 3
    dl.record_step(128, 0.1)
    assert dl.seconds_at(96) == pytest.approx(0.075)
    assert dl.choose(64, 0) == 0  # rows cost, drafts are all rejected
    assert dl.choose(0, 10) == 3  # nobody to draft for: nothing to decide


def test_a_step_without_drafts_is_measured_once_when_it_never_was():
    dl = DraftLength(2)
    dl.record_asked(64, 2)
    for _ in range(64):
        dl.record_verified(2, 2)
    for _ in range(5):
        dl.record_step(192, 0.02)  # every step so far verified two drafts a request
    assert dl.choose(64, 0) == 0  # how much cheaper 64 rows are is not known: try it
    dl.record_step(64, 0.0195)
    assert dl.choose(64, 0) == 2  # and it is barely cheaper: the drafts pay


def test_the_proposers_own_time_counts_against_its_drafts():
    flat = measured(1, lambda rows: 5e-3, [0.5])
    assert flat.choose(4, 0) == 1  # drafts cost the step nothing
    flat.record_proposer(4, 1, 4 * 1e-3)  # 1 ms a request: 4 tokens in 5 ms vs 6 in 9
    assert flat.choose(4, 0) == 0
    # measured drafting for 32 requests at once: 3 ms; for one request it is taken to
    # cost no less (an MTP forward's time is mostly the same for one row as for many),
    # not a 32nd of it
    fixed = measured(1, lambda rows: 5e-3, [0.5])
    fixed.record_proposer(32, 1, 3e-3)
    assert fixed.choose(32, 0) == 0  # 48 tokens in 8 ms against 32 in 5
    assert fixed.choose(1, 0) == 0  # 1.5 tokens in 8 ms against 1 in 5
    fixed.record_proposer(1, 1, 1e-4)  # measured: one request's drafts are cheaper
    assert fixed.choose(1, 0) == 1
    cheap = measured(3, lambda rows: 5e-3, [0.5, 0.5, 0.5])
    cheap.record_proposer(4, 3, 4 * 3e-5)
    assert cheap.choose(4, 0) == 3 and cheap.seconds_at(16) == pytest.approx(5e-3)


def test_drafts_pay_when_a_step_costs_the_same_whatever_its_rows():
    flat = measured(3, lambda rows: 5e-3 + 1e-7 * rows, [0.3, 0.3, 0.3])
    assert flat.choose(1, 0) == 3 and flat.choose(64, 0) == 3


def test_compute_bound_steps_draft_only_at_low_load_when_drafts_are_mostly_rejected():
    dl = measured(3, compute_bound, [0.3, 0.3, 0.3])
    assert dl.choose(1, 0) >= 1  # a 1 ms step: a row more costs 0.1 ms
    assert dl.choose(64, 0) == 0  # 7.4 ms for 64 tokens, 26.6 ms for about 90
    # one draftable request among 200 others: its drafts change the step's rate by
    # less than the tie margin, and the longest of tied lengths is taken
    assert dl.choose(1, 200) == 3
    assert dl.choose(32, 200) == 0  # 32 of them: the drafts' rows cost the step


def test_well_accepted_drafts_pay_even_on_full_compute_bound_steps():
    dl = measured(3, compute_bound, [0.98, 0.98, 0.98])
    assert dl.choose(64, 0) >= 1
    rejected = measured(3, compute_bound, [0.02, 0.02, 0.02])
    assert rejected.choose(64, 0) == 0


def test_it_follows_the_acceptance_as_it_changes():
    dl = measured(3, compute_bound, [0.98, 0.98, 0.98])
    assert dl.choose(64, 0) >= 1
    measured(3, compute_bound, [0.0, 0.0, 0.0], steps=400, into=dl)
    assert dl.choose(64, 0) == 0
    measured(3, compute_bound, [1.0, 1.0, 1.0], steps=400, into=dl)
    assert dl.choose(64, 0) >= 1


def test_a_length_not_asked_lately_is_asked_for_again():
    dl = measured(3, lambda rows: 5e-3, [0.5, 0.5, 0.5])
    # a long run asked for one draft only: positions 2 and 3 fade out of the counts
    for _ in range(400):
        dl.record_asked(8, 1)
        for _ in range(8):
            dl.record_verified(1, 1)
    assert dl.asked[1] < MIN_ASKED <= dl.asked[0]
    assert dl.choose(8, 0) == 3  # one draft pays; whether more do is asked again
    # and when the lengths measured show fewer pay, the longer ones are not asked
    for _ in range(400):
        dl.record_asked(64, 1)
        for _ in range(64):
            dl.record_verified(1, 0)
    slow = measured(3, compute_bound, [0.0], steps=0, into=dl)
    assert slow.choose(64, 0) == 0


def spec(method: str = "ngram", **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method, 3, 1, 4, **kw)


def test_adaptive_drafts_as_the_config_says():
    raw = {"method": "ngram", "num_speculative_tokens": 2}
    assert SpeculativeConfig.from_dict(raw).adaptive
    assert not SpeculativeConfig.from_dict({**raw, "adaptive_drafts": False}).adaptive
    with pytest.raises(ValueError, match="speculative_config.adaptive_drafts: must be true"):
        SpeculativeConfig.from_dict({**raw, "adaptive_drafts": "no"})


class Scripted(DraftLength):
    """The engine's DraftLength with its choices scripted (it still records)."""

    def __init__(self, k: int, choices):
        super().__init__(k)
        self.choices = choices
        self.asked_for: list[int] = []

    def choose(self, drafted: int, others: int) -> int:
        k = self.choices(len(self.asked_for))
        self.asked_for.append(k)
        return k


def repetitive(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [([rng.randrange(10, 900) for _ in range(rng.randrange(2, 6))] * 20)
            [:rng.randrange(12, 60)] for _ in range(n)]


def test_the_engine_measures_its_steps_and_drafts_what_is_chosen(qwen3_path):
    ps = repetitive(6)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want, _ = run(qwen3_path, ps, params)
    got, llm = run(qwen3_path, ps, params, speculative_config=spec())
    dl = llm.engine.draft_length
    assert got == want and dl is not None
    assert dl.asked[0] > 0 and dl.verified[0] > 0 and len(dl._steps) >= 2
    assert run(qwen3_path, ps[:1], params, speculative_config=spec(adaptive=False)
               )[1].engine.draft_length is None
    # choices of none, then one, then none again: the output stays, only what is chosen
    # is drafted
    llm = LLM(str(qwen3_path), device="cpu", block_size=16, speculative_config=spec())
    llm.engine.speculation.draft_length = scripted = Scripted(3, lambda i: 1 if 4 <= i < 12 else 0)
    outs = llm.generate(ps, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = llm.engine.spec_stats
    assert 0 < stats.num_drafts and stats.num_draft_tokens == stats.num_drafts
    assert stats.num_drafts <= 8 * len(ps) and scripted.asked_for.count(0) > 0
    assert stats.draft_length == scripted.asked_for[-1]  # (the metrics' gauge)
    assert_no_block_held(llm)


def test_an_mtp_step_drafting_nothing_skips_the_mtp_layer(tiny_models):
    """After a step that drafts nothing its requests' MTP KV has a gap: they are drafted
    for no more; requests that come later are. The output is unchanged throughout."""
    model = tiny_models["deepseek_v3"]
    ps = repetitive(4, seed=1)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want, _ = run(model, ps + ps[:2], params)
    llm = LLM(str(model), device="cpu", block_size=16, speculative_config=spec("mtp"))
    proposer = llm.engine.proposer
    forwards = []  # the MTP layer's forwards (absorbing a step, or chaining drafts)
    real = proposer._run
    proposer._run = lambda *args, **kw: (forwards.append(1), real(*args, **kw))[1]
    llm.engine.speculation.draft_length = scripted = Scripted(3, lambda i: 3 if i < 3 else 0)
    first = llm.generate(ps, params)
    assert [o.outputs[0].token_ids for o in first] == want[:4]
    drafted = llm.engine.spec_stats.num_drafts
    # three steps drafted for (the MTP layer absorbing each and chaining two drafts);
    # then none: the requests were gapped, and not offered for drafts again
    assert scripted.asked_for == [3, 3, 3, 0]
    assert 0 < drafted <= 3 * len(ps) and 0 < len(forwards) <= 3 * 3
    llm.engine.speculation.draft_length = Scripted(3, lambda i: 3)
    second = llm.generate(ps[:2], params)  # new requests: drafted for again
    assert [o.outputs[0].token_ids for o in second] == want[4:]
    assert llm.engine.spec_stats.num_drafts > drafted
    assert_no_block_held(llm)


def test_lengths_not_chosen_for_a_while_are_tried_again():
    """Choosing none is not forever: the decisions age the counts, and once the drafts'
    evidence has faded they are asked for again (their step times may have been measured
    while the machine was busier)."""
    dl = measured(3, compute_bound, [0.3, 0.3, 0.3])
    assert dl.choose(64, 0) == 0
    for _ in range(1000):
        k = dl.choose(64, 0)
        dl.record_asked(64, k)
        if k:
            break
    assert k == 3
