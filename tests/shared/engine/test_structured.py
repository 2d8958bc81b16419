"""Structured output in the engine: the grammar's mask holds for greedy and sampled
requests, its state is rebuilt from the tokens a request arrives with, a complete
grammar ends the request, and logit_bias shifts the logits it names."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
import torch

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.engine.structured import (
    GrammarCompiler,
    apply_bitmask,
    choice_grammar,
    json_schema_grammar,
    lark_grammar,
    new_bitmask,
    regex_grammar,
)

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "count", "ok", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "count": {"type": "integer", "minimum": 0, "maximum": 999},
                         "ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]}}}


@pytest.fixture(scope="module")
def llm(qwen3_path):
    return LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)


def texts(llm, prompts, **kw):
    outs = llm.generate(prompts, SamplingParams(**kw))
    return [o.outputs[0] for o in outs]


def test_json_schema_output_validates_greedy_and_sampled(llm):
    grammar = json_schema_grammar(SCHEMA)
    prompts = [list(range(30 + 9 * i, 50 + 9 * i)) for i in range(6)]
    greedy = texts(llm, prompts, temperature=0, max_tokens=64, grammar=grammar)
    sampled = texts(llm, prompts, temperature=1.0, seed=7, max_tokens=64, grammar=grammar)
    for out in greedy + sampled:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in sampled}) > 1  # sampling still chooses within the grammar


@pytest.mark.parametrize(("grammar", "check"), [
    (regex_grammar(r"[0-9]{3}-[a-z]{2}"), lambda t: len(t) == 6 and t[3] == "-"
     and t[:3].isdigit() and t[4:].isalpha()),
    (choice_grammar(["red (warm)", "blue|cold", "green.*"]),
     lambda t: t in ("red (warm)", "blue|cold", "green.*")),
    (lark_grammar('start: "x=" NUM ";"\nNUM: /[1-9][0-9]?/'),
     lambda t: t.startswith("x=") and t.endswith(";") and t[2:-1].isdigit()),
    (lark_grammar('root ::= "yes" | "no"'), lambda t: t in ("yes", "no")),  # GBNF
])
def test_regex_choice_and_grammar_outputs_match(llm, grammar, check):
    for out in texts(llm, [[5, 6, 7], [900, 901]], temperature=0.8, seed=3, max_tokens=32,
                     grammar=grammar):
        assert out.finish_reason == "stop" and check(out.text), out.text


def test_grammar_state_is_rebuilt_from_carried_tokens(llm):
    """A request continued elsewhere (decode after prefill) from k tokens masks exactly
    as the uninterrupted one: same greedy output."""
    grammar = json_schema_grammar(SCHEMA)
    prompt = list(range(200, 230))
    whole = texts(llm, [prompt], temperature=0, max_tokens=64, grammar=grammar)[0]
    for k in (1, 4):
        req = llm.engine.add_request(prompt, SamplingParams(
            temperature=0, max_tokens=64, grammar=grammar), output_token_ids=whole.token_ids[:k])
        while not req.is_finished:
            llm.engine.step()
        assert req.output_token_ids == whole.token_ids
        assert req.finish_reason == "stop"


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(llm):
    out = texts(llm, [[1, 2, 3]], temperature=0, max_tokens=20, ignore_eos=True,
                grammar=choice_grammar(["done"]))[0]
    assert out.text == "done" and out.finish_reason == "stop"


def test_a_complete_grammar_ends_on_the_end_of_sequence_as_vllm(llm):
    """Complete, the grammar allows only the end of sequence: it is sampled next and
    counted, with its logprobs (vLLM's usage and logprobs count it too); the text is
    the grammar's alone."""
    eos = llm.tokenizer.eos_token_id
    for choice in (["done"], ["a", "bb"]):
        out = texts(llm, [[1, 2, 3]], temperature=0, max_tokens=20, logprobs=1,
                    grammar=choice_grammar(choice))[0]
        assert out.text in choice and out.finish_reason == "stop"
        assert out.token_ids[-1] == eos and len(out.logprobs) == len(out.token_ids)
        assert out.token_ids[:-1] == llm.tokenizer.encode(out.text, add_special_tokens=False)


def test_a_bad_grammar_is_refused_naming_it(llm):
    good = SamplingParams(max_tokens=4, grammar=regex_grammar("a+"))
    with pytest.raises(ValueError, match="grammar: not valid"):  # before any runs
        llm.generate([[1, 2], [3, 4]], [good, SamplingParams(
            max_tokens=4, grammar=regex_grammar("(("))])
    assert not llm.engine.has_unfinished()


def test_logit_bias_moves_the_greedy_choice(llm):
    plain = texts(llm, [[40, 41, 42]], temperature=0, max_tokens=4)[0]
    target = next(t for t in range(100, 200) if t not in plain.token_ids)
    biased = texts(llm, [[40, 41, 42]], temperature=0, max_tokens=4,
                   logit_bias={target: 100.0})[0]
    assert biased.token_ids == [target] * 4
    banned = texts(llm, [[40, 41, 42]], temperature=0, max_tokens=4,
                   logit_bias={plain.token_ids[0]: -100.0})[0]
    assert banned.token_ids[0] != plain.token_ids[0]


def test_bitmask_masks_only_its_rows(qwen3_path):
    compiler = GrammarCompiler(qwen3_path / "tokenizer.json", 4096, (2,))
    g = compiler.start(regex_grammar("ab"))
    mask = new_bitmask(1, 4096)
    g.fill(mask, 0)
    logits = torch.zeros(3, 4096)
    out = apply_bitmask(logits, [1], mask)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    allowed = (out[1] > float("-inf")).nonzero().flatten().tolist()
    assert allowed and len(allowed) < 4096
    with pytest.raises(ValueError, match="unclosed group"):
        compiler.start(regex_grammar("(("))


def test_prepare_builds_the_tokenizer_in_the_background(qwen3_path, tmp_path, caplog):
    """A serving engine builds llguidance's tokenizer at its start, off its step loop;
    one it cannot read is a warning then (and the grammar request's error later)."""
    compiler = GrammarCompiler(qwen3_path / "tokenizer.json", 4096, (2,))
    compiler.prepare()
    deadline = time.monotonic() + 60
    while compiler._tokenizer is None:
        assert time.monotonic() < deadline, "the tokenizer was never built"
        time.sleep(0.05)
    assert compiler.start(regex_grammar("ab")).error is None
    broken = GrammarCompiler(tmp_path / "missing.json", 4096, (2,))
    with caplog.at_level("WARNING"):
        broken.prepare()
        deadline = time.monotonic() + 60
        while "cannot read" not in caplog.text:
            assert time.monotonic() < deadline, "no warning"
            time.sleep(0.05)
    assert "missing.json" in caplog.text
    with pytest.raises(ValueError, match="grammar: structured output needs the model's "
                                         "missing.json"):
        broken.start(regex_grammar("ab"))


def test_markup_that_decodes_as_text_is_text_to_a_grammar(tiny_models):
    """DeepSeek-V4's ``</think>`` / ``<｜User｜>`` are non-special added tokens: text when
    decoded, so a grammar's text matches them (llguidance alone would read them as
    special tokens, match "</think>" by other tokens, then refuse the one it offered),
    and the model's markup token itself is accepted where its text fits."""
    from pdmesh.shared.models import Tokenizer
    from pdmesh.shared.models import encoding_dsv4 as dsv4

    path = tiny_models["deepseek_v4"]
    tok = Tokenizer(path, mode="deepseek_v4")
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16)
    want = f"no{dsv4.THINK_END}yes {dsv4.USER}{dsv4.DSML}"
    out = texts(llm, [[40, 41, 42], [7, 8]], temperature=0, max_tokens=60,
                grammar=choice_grammar([want]))
    assert [o.text for o in out] == [want, want]
    assert all(o.finish_reason == "stop" for o in out)
    compiler = GrammarCompiler(path / "tokenizer.json", 4096, (tok.eos_token_id,))
    g = compiler.start(choice_grammar([want]))
    ids = tok.encode(want, add_special_tokens=False)
    assert tok.encode(dsv4.THINK_END, add_special_tokens=False)[0] in ids
    assert g.matcher.consume_tokens(ids) and not g.matcher.is_error()
    assert compiler.tokenizer.is_special_token(tok.eos_token_id)  # special stays special


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v4"])  # </think>: pieces / a token
def test_a_grammar_after_reasoning_binds_only_what_follows_it(tiny_models, arch):
    from pdmesh.shared.models import Tokenizer

    path = tiny_models[arch]
    tok = Tokenizer(path)
    compiler = GrammarCompiler(path / "tokenizer.json", 4096, (tok.eos_token_id,))
    g = compiler.start(choice_grammar(["yes", "no"]), after="</think>")
    reasoning = tok.encode("maybe {not} json </th", add_special_tokens=False)
    close = tok.encode("ink>", add_special_tokens=False) if arch == "qwen3" else []
    if arch == "deepseek_v4":  # V4 writes it as one token
        reasoning = reasoning[:-2] + tok.encode("</think>", add_special_tokens=False)
    answer = tok.encode("yes", add_special_tokens=False)
    mask = new_bitmask(1, 4096)
    for i in range(1, len(reasoning + close) + 1):
        g.sync((reasoning + close)[:i])
        g.fill(mask, 0)
        assert bool((mask == -1).all()) == (i < len(reasoning + close)), i
        assert not g.done
    mask = new_bitmask(1, 4096)
    g.fill(mask, 0)  # closed: only the grammar's tokens from here
    allowed = apply_bitmask(torch.zeros(1, 4096), [0], mask)[0] > float("-inf")
    assert allowed[answer[0]] and allowed.sum() < 10
    g.sync(reasoning + close + answer)
    assert g.done and g.error is None
    # a decode instance rebuilds it from the tokens it arrives with, all at once
    carried = compiler.start(choice_grammar(["yes", "no"]), after="</think>")
    carried.sync(reasoning + close)
    again = new_bitmask(1, 4096)
    carried.fill(again, 0)
    assert torch.equal(again, mask)
    carried.sync(reasoning + close + answer)
    assert carried.done and carried.error is None
    # a refused token is recorded (the engine fails the request with it)
    broken = compiler.start(choice_grammar(["yes"]))
    broken.sync(tok.encode("no", add_special_tokens=False))
    assert broken.error and broken.done


def test_output_its_grammar_refuses_ends_the_request_as_an_error(llm, qwen3_path):
    """A request continuing with tokens its grammar refuses (carried in from elsewhere)
    ends with finish_reason "error" (the gateway's 500), not as a silent "stop"."""
    from pdmesh.shared.models import Tokenizer

    wrong = Tokenizer(qwen3_path).encode("nope", add_special_tokens=False)
    req = llm.engine.add_request([40, 41, 42], SamplingParams(
        temperature=0, max_tokens=20, grammar=choice_grammar(["yes"])),
        output_token_ids=wrong)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert req.finish_reason == "error"
    with pytest.raises(ValueError, match="grammar_after"):
        SamplingParams(grammar_after="</think>")  # without a grammar


def test_sampling_params_check_bias_and_grammar():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(grammar=5)  # type: ignore[arg-type]
