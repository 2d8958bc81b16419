"""bad_words as the gateway hands them to the engine: tokenized as vLLM tokenizes them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdmesh.services.gateway.constraints import bad_words_token_ids
from pdmesh.services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from pdmesh.shared.models.tokenizer import Tokenizer


def test_bad_words_are_banned_bare_and_inside_a_text(qwen3_path):
    """Each word as it is (leading spaces stripped), and with a leading space when that
    spells it with as many tokens starting with another one; never a longer spelling."""
    tok = Tokenizer(qwen3_path)

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    got = bad_words_token_ids(["  return", "hello world", "é"], tok)
    assert ids(" return") != ids("return") and len(ids(" é")) > len(ids("é"))
    assert got == [ids("return"), ids(" return"), ids("hello world"), ids(" hello world"),
                   ids("é")]


@pytest.mark.parametrize("words", [["ok", ""], ["   "], [5], "word"])
def test_a_bad_word_that_is_not_text_is_refused_naming_bad_words(words):
    for body in ({"model": "m", "prompt": "x"},
                 {"model": "m", "messages": [{"role": "user", "content": "hi"}]}):
        kind = CompletionRequest if "prompt" in body else ChatCompletionRequest
        with pytest.raises(ValidationError) as e:
            kind.model_validate({**body, "bad_words": words})
        assert e.value.errors()[0]["loc"][0] == "bad_words"


def test_structured_outputs_config_as_vllm_reads_it(caplog):
    from pdmesh.services.gateway.constraints import grammar_in_reasoning, reasoning_parser_named

    assert grammar_in_reasoning(None) is False
    assert grammar_in_reasoning({"enable_in_reasoning": True}) is True
    with caplog.at_level("WARNING"):
        assert grammar_in_reasoning({"backend": "xgrammar", "disable_fallback": True}) is False
    assert "backend 'xgrammar'" in caplog.text and "disable_fallback" in caplog.text
    for bad, needle in (({"yaml": 1}, r"unknown key\(s\) yaml"), ({"backend": "x"}, "backend"),
                        ({"enable_in_reasoning": "yes"}, "enable_in_reasoning")):
        with pytest.raises(ValueError, match=needle):
            grammar_in_reasoning(bad)
    # its reasoning_parser key names the parser as --reasoning-parser does
    assert reasoning_parser_named({"reasoning_parser": "qwen3"}, None) == "qwen3"
    assert reasoning_parser_named(None, "qwen3") == "qwen3"
    with pytest.raises(ValueError, match="is not --reasoning-parser's"):
        reasoning_parser_named({"reasoning_parser": "qwen3"}, "deepseek_r1")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        reasoning_parser_named({"reasoning_parser": "nope"}, None)
