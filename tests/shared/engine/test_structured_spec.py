"""Structured output with speculative decoding: a grammar masks each verified position as
it would mask that token sampled alone (``Grammar.fill_drafts``), so greedy output is
token-identical to decoding one token a step (n-gram drafts here, MTP drafts in
test_mtp.py), sampled output obeys the grammar, and a grammar completed inside the kept
drafts ends the request there."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.engine.structured import (
    GrammarCompiler,
    choice_grammar,
    json_schema_grammar,
    new_bitmask,
    regex_grammar,
)
from pdmesh.shared.models import Tokenizer
from tests.shared.engine.spec_runs import assert_no_block_held

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "count", "ok", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "count": {"type": "integer", "minimum": 0, "maximum": 999},
                         "ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]}}}
LIST = {"type": "array", "items": {"enum": ["cat", "dog", "bird"]}, "minItems": 3,
        "maxItems": 14}
EXAMPLES = '{"name":"ab","count":12,"ok":true,"kind":"cat"} ["cat","dog","bird","dog"] '
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 4, "adaptive_drafts": False}


@pytest.fixture(scope="module")
def tok(qwen3_path):
    return Tokenizer(qwen3_path)


@pytest.fixture(scope="module")
def prompts(tok):
    """Examples of the outputs (so the n-gram drafts follow them), then a few words."""
    tails = ["x", "hello there", '{"na', "[", "dog", "count 7", "why not", "ok"]
    return [tok.encode(EXAMPLES * (2 + i % 3) + t, add_special_tokens=False)
            for i, t in enumerate(tails)]


def outputs(model, prompts, params, **engine):
    """(Each output, the engine) from a fresh CPU engine."""
    llm = LLM(str(model), device="cpu", dtype="float32", block_size=16, **engine)
    return [o.outputs[0] for o in llm.generate(prompts, params)], llm


def assert_speculated(llm) -> None:
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_no_block_held(llm)


# -- the masks along the drafts ---------------------------------------------------------
def fresh_fill(compiler, grammar, outputs, after=None) -> torch.Tensor:
    """The mask ``fill`` gives after ``outputs`` sampled one by one (a new matcher)."""
    g = compiler.start(grammar, after=after)
    g.sync(outputs)
    mask = new_bitmask(1, 4096)
    g.fill(mask, 0)
    return mask[0]


def test_fill_drafts_gives_each_position_the_mask_sampling_would(qwen3_path, tok):
    compiler = GrammarCompiler(qwen3_path / "tokenizer.json", 4096, (tok.eos_token_id,))
    grammar = json_schema_grammar(SCHEMA)
    text = tok.encode('{"name":"ab","count":12,"ok":true,"kind":"cat"}',
                      add_special_tokens=False)
    bad = tok.encode("]", add_special_tokens=False)[0]
    g = compiler.start(grammar)
    g.sync(text[:3])
    before = new_bitmask(1, 4096)
    g.fill(before, 0)
    drafts = text[3:7] + [bad] + text[7:9]  # four the grammar takes, then one it refuses
    mask = new_bitmask(2 + len(drafts), 4096)
    assert g.fill_drafts(mask, 1, drafts) == 4
    assert bool((mask[0] == -1).all())  # rows not its own untouched
    for j in range(5):
        assert torch.equal(mask[1 + j], fresh_fill(compiler, grammar, text[:3 + j])), j
    assert bool((mask[6:] == -1).all())  # past the refused draft: nothing to mask
    after = new_bitmask(1, 4096)
    g.fill(after, 0)
    assert torch.equal(before, after) and not g.matcher.is_error()  # back where it was
    g.sync(text)
    assert g.done and g.error is None
    # drafts that complete the grammar: the one after them is refused
    g = compiler.start(grammar)
    g.sync(text[:-2])
    mask = new_bitmask(3, 4096)
    assert g.fill_drafts(mask, 0, text[-2:] + [text[0]]) == 2
    g.sync(text)
    assert g.done and g.error is None


@pytest.mark.parametrize("grammar", [choice_grammar(["yes please", "no"]),
                                     regex_grammar("yes please|no")])
def test_fill_drafts_past_a_grammar_that_stops_at_its_end(qwen3_path, tok, grammar):
    """A grammar that stops once complete, then a drafted end of sequence (MTP and
    n-gram drafts both propose one): the drafts up to the completion are taken, and the
    matcher goes back to where it was (it records nothing for the end of sequence)."""
    compiler = GrammarCompiler(qwen3_path / "tokenizer.json", 4096, (tok.eos_token_id,))
    text = tok.encode("yes please", add_special_tokens=False)
    g = compiler.start(grammar)
    g.sync(text[:1])
    before = new_bitmask(1, 4096)
    g.fill(before, 0)
    drafts = [*text[1:], tok.eos_token_id, tok.eos_token_id]
    mask = new_bitmask(1 + len(drafts), 4096)
    assert g.fill_drafts(mask, 0, drafts) == len(text) - 1
    again = new_bitmask(1, 4096)
    g.fill(again, 0)
    assert torch.equal(before, again) and not g.matcher.is_error()
    g.sync(text)
    assert g.done and g.error is None


def test_fill_drafts_leaves_the_reasoning_free_and_binds_after_it(qwen3_path, tok):
    compiler = GrammarCompiler(qwen3_path / "tokenizer.json", 4096, (tok.eos_token_id,))
    grammar = choice_grammar(["yes", "no"])
    thinking = tok.encode("maybe {not} json", add_special_tokens=False)
    close = tok.encode(" </think>", add_special_tokens=False)
    assert len(close) > 1  # (the closing text in pieces: the scan spans drafts)
    yes = tok.encode("yes", add_special_tokens=False)
    g = compiler.start(grammar, after="</think>")
    g.sync(thinking[:2])
    drafts = thinking[2:] + close + yes + [yes[0]]
    mask = new_bitmask(1 + len(drafts), 4096)
    free = len(thinking) - 2 + len(close)
    assert g.fill_drafts(mask, 0, drafts) == free + len(yes)
    assert bool((mask[:free] == -1).all())  # the reasoning: anything
    for j in range(len(yes) + 1):
        want = fresh_fill(compiler, grammar, thinking + close + yes[:j], after="</think>")
        assert torch.equal(mask[free + j], want) and not bool((want == -1).all()), j
    assert not g.active  # the scan was tentative: the reasoning is still open
    mask = new_bitmask(3, 4096)
    assert g.fill_drafts(mask, 0, thinking[2:4]) == 2 and bool((mask == -1).all())
    g.sync(thinking + close + yes)
    assert g.done and g.error is None


# -- the engine -------------------------------------------------------------------------
@pytest.mark.parametrize("grammar", [json_schema_grammar(SCHEMA), json_schema_grammar(LIST),
                                     regex_grammar(r'\["(cat|dog)"(,"(cat|dog|bird)"){2,9}\]'),
                                     choice_grammar(['{"name":"ab","count":12}', "cat dog"])])
def test_greedy_with_a_grammar_is_token_identical_with_drafts(qwen3_path, prompts, grammar):
    params = SamplingParams(temperature=0, max_tokens=64, grammar=grammar)
    want, _ = outputs(qwen3_path, prompts, params)
    got, llm = outputs(qwen3_path, prompts, params, speculative_config=NGRAM)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.finish_reason == "stop" for o in got), [o.text for o in got]
    if grammar == json_schema_grammar(SCHEMA):
        for o in got:
            jsonschema.validate(json.loads(o.text), SCHEMA)
    assert_speculated(llm)


def test_a_grammar_complete_inside_the_kept_drafts_ends_the_request_there(qwen3_path, tok):
    """The drafts run past the grammar's end: the verifier keeps up to the completing
    draft and a token after it, the scheduler cuts the output at the completion."""
    prompt = tok.encode("x=12; x=12; x=12; x=12; x=12; x=1", add_special_tokens=False)
    grammar = regex_grammar("x=12; x=12; x=12;")
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, grammar=grammar)
    want, _ = outputs(qwen3_path, [prompt], params)
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16,
              speculative_config=NGRAM)
    verified: list[list[int]] = []
    verify = llm.engine.sampler.verify

    def spy(*args, **kw):
        kept = verify(*args, **kw)
        verified.extend(list(k) for k in kept)  # (before the scheduler cuts them)
        return kept

    llm.engine.sampler.verify = spy
    got = llm.generate([prompt], params)[0].outputs[0]
    assert got.token_ids == want[0].token_ids and got.text == "x=12; x=12; x=12;"
    assert got.finish_reason == "stop"
    last = verified[-1]  # the completing token a kept draft, the target's after it cut
    assert len(last) > 1 and got.token_ids[-(len(last) - 1):] == last[:-1]
    assert_speculated(llm)


def test_sampled_outputs_with_drafts_obey_the_grammar(qwen3_path, prompts):
    grammar = json_schema_grammar(SCHEMA)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=64, grammar=grammar)
    got, llm = outputs(qwen3_path, prompts, params, speculative_config=NGRAM)
    for o in got:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in got}) > 1
    assert_speculated(llm)
    again, _ = outputs(qwen3_path, prompts, params, speculative_config=NGRAM)
    assert [o.token_ids for o in again] == [o.token_ids for o in got]  # seeded


def test_a_grammar_after_reasoning_speculates_exactly(qwen3_path, prompts, tok):
    """The reasoning is free, the grammar binds after the closing text: here two tokens
    the model writes unconstrained (its first pair not seen before), so the reasoning
    closes mid-output, the drafts reading it and the grammar's part alike."""
    free, _ = outputs(qwen3_path, prompts[:1], SamplingParams(temperature=0, max_tokens=40,
                                                               ignore_eos=True))
    ids = free[0].token_ids
    pairs = list(zip(ids[:-1], ids[1:], strict=True))  # pairs[k]: tokens k and k + 1
    j = next(j for j in range(8, 40) if pairs[j - 1] not in pairs[:j - 1])
    close = tok.decode(ids[j - 1:j + 1])
    assert close not in tok.decode(ids[:j])
    params = SamplingParams(temperature=0, max_tokens=96, grammar=json_schema_grammar(LIST),
                            grammar_after=close)
    want, _ = outputs(qwen3_path, prompts[:1], params)
    got, llm = outputs(qwen3_path, prompts[:1], params, speculative_config=NGRAM)
    assert got[0].token_ids == want[0].token_ids
    assert got[0].token_ids[:j + 1] == ids[:j + 1] and got[0].finish_reason == "stop"
    jsonschema.validate(json.loads(tok.decode(got[0].token_ids[j + 1:])), LIST)
    assert_speculated(llm)


def test_logit_bias_speculates_exactly(qwen3_path, prompts, tok):
    bias = {tok.encode("dog", add_special_tokens=False)[0]: 5.0, 7: -100.0}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias=bias)
    want, _ = outputs(qwen3_path, prompts, params)
    plain, _ = outputs(qwen3_path, prompts, SamplingParams(temperature=0, max_tokens=24,
                                                           ignore_eos=True))
    assert [o.token_ids for o in want] != [o.token_ids for o in plain]  # the bias bites
    got, llm = outputs(qwen3_path, prompts, params, speculative_config=NGRAM)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert_speculated(llm)
