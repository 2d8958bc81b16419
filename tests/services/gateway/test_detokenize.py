"""Incremental detokenization: the streamed text is exactly the full decode, with stop
strings cut and incomplete characters never released."""

from __future__ import annotations

import random

import pytest

from pdmesh.services.gateway.detokenize import IncrementalText
from pdmesh.shared.models.tokenizer import Tokenizer

TEXTS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "naïve café — 中文字符 and emoji 🚀🎉 mixed with ASCII",
    "  leading spaces, trailing spaces   \n\n\ttabs\t and \"quotes\" 'here'",
]


@pytest.fixture(scope="module")
def tok(qwen3_path) -> Tokenizer:
    return Tokenizer(qwen3_path)


def stream(tok: Tokenizer, ids: list[int], stops: list[str], rng: random.Random,
           skip: bool = True) -> tuple[list[str], str]:
    inc = IncrementalText(tok, stops, skip)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])
        deltas.append(inc.add(ids[i:i + n]))
        i += n
    deltas.append(inc.flush())
    return deltas, "".join(deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_the_full_decode(tok, text):
    ids = tok.encode(text)
    rng = random.Random(0)
    deltas, out = stream(tok, ids, [], rng)
    assert out == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)  # no half characters released


def whole(tok: Tokenizer, ids: list[int]) -> str:
    """The full decode of the longest head of ``ids`` that does not end inside a
    character: what an answer that ends there says (vLLM's)."""
    end = len(ids)
    while end and tok.decode(ids[:end]).endswith("\ufffd"):
        end -= 1
    return tok.decode(ids[:end])


def test_random_token_ids_match_the_full_decode(tok):
    rng = random.Random(1)
    vocab = tok.vocab_size
    for _ in range(50):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
        _, out = stream(tok, ids, [], rng)
        assert out == whole(tok, ids)


def test_an_answer_cut_inside_a_character_ends_before_it(tok):
    """The token limit came inside a character (an emoji's bytes over several tokens):
    its bytes are not sent as U+FFFD, as vLLM withholds them."""
    ids = tok.encode("ok 🚀")
    cut = next(k for k in range(len(ids), 0, -1) if tok.decode(ids[:k]).endswith("\ufffd"))
    for seed in range(3):
        deltas, out = stream(tok, ids[:cut], [], random.Random(seed))
        assert out == "ok " and not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text,stop", [(TEXTS[0], "fib(n - 1)"), (TEXTS[1], "🚀"),
                                       (TEXTS[2], "\t and")])
def test_stop_strings_cut_the_text(tok, text, stop):
    ids = tok.encode(text)
    _, out = stream(tok, ids, [stop, "never appears"], random.Random(2))
    assert out == text[:text.index(stop)]


def test_stop_string_in_the_last_tokens_is_cut_at_flush(tok):
    text = "the end is here: STOP"
    ids = tok.encode(text)
    inc = IncrementalText(tok, ["STOP"], True)
    out = inc.add(ids) + inc.flush()
    assert out == "the end is here: "
