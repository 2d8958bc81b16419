"""Structured output: a request's grammar as a mask on its next token's logits.

A request carries its grammar as text (``SamplingParams.grammar``: what llguidance's
``LLMatcher.grammar_from_json_schema`` / ``_regex`` / ``_lark`` return, built at the
gateway from ``response_format`` or vLLM's ``structured_outputs`` / ``guided_*``). The
engine holds one llguidance matcher per such request, fed with the request's output
tokens: before each sampling the matcher catches up on the tokens it has not seen, so a
request that arrives carrying tokens (a decode instance continuing a prefill, a
hand-back, a recompute after preemption) rebuilds its grammar state from them, and a
moved request masks exactly as it would have where it was. Tokens the grammar forbids
get -inf before anything else in the sampler; once the grammar is complete, only the
end of sequence is allowed.

    gateway: schema ──grammar_from_*──▶ grammar text ──(gRPC)──▶ engine
    engine:  Grammar.start(text) ── sync(outputs) ── fill(row of a [B, V/32] bitmask)
    drafts:  fill_drafts(1 + d rows): the matcher through the drafts and back (the
             verifier picks each position from its masked distribution)

With a reasoning parser at the gateway, a request that starts out thinking carries the
text closing its reasoning (``SamplingParams.grammar_after``, e.g. ``</think>``): its
grammar binds only what follows it, as vLLM applies structured output after reasoning.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (the gateway compiles grammars without torch)
    import torch

log = logging.getLogger(__name__)


def _llguidance() -> Any:
    import llguidance  # (imported when a grammar is first asked for)

    return llguidance


def check_grammar(grammar: str) -> None:
    """ValueError naming the grammar's fault (no tokenizer needed: the gateway's check
    before a request is sent)."""
    err = _llguidance().LLMatcher.validate_grammar(grammar)
    if err:
        raise ValueError(f"grammar: not valid: {err}")


class GrammarCompiler:
    """One engine's tokenizer as llguidance reads it (~1 s to build for a large
    vocabulary: on first use, or beforehand in a thread of its own by ``prepare``), and
    the matchers it makes."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer_json = Path(tokenizer_json)
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self.eos_token_ids = tuple(eos_token_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def prepare(self) -> None:
        """Build the tokenizer in the background (a serving engine's start); a request
        needing it first waits for it."""
        threading.Thread(target=self._build, name="grammar-tokenizer", daemon=True).start()

    def _build(self) -> None:
        try:
            _ = self.tokenizer
        except Exception as e:  # (a grammar request gets the same fault as its error)
            log.warning("structured output: cannot read %s for grammars: %s",
                        self.tokenizer_json, e)

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                llg = _llguidance()
                eos = list(self.eos_token_ids) or None
                try:
                    text = markup_as_text(self.tokenizer_json.read_text())
                    self._tokenizer = llg.LLTokenizer(text, n_vocab=self.vocab_size,
                                                      eos_token=eos)
                except Exception as e:  # (a request's error, not the engine's)
                    raise ValueError(f"grammar: structured output needs the model's "
                                     f"{self.tokenizer_json.name}, which cannot be read "
                                     f"({type(e).__name__}: {e})") from e
            return self._tokenizer

    def check_accepts(self, grammar: str) -> None:
        """ValueError when ``grammar`` (valid) accepts no output at all: a schema whose
        only content is a reference to itself, types no value can have together. Found
        the way the engine would meet it: the first token's mask, in error or empty."""
        matcher = _llguidance().LLMatcher(self.tokenizer, grammar, log_level=0)
        allowed = b"" if matcher.is_error() else matcher.compute_logit_bias()
        if matcher.is_error() or not any(allowed):
            why = matcher.get_error().strip().splitlines()
            raise ValueError("grammar: accepts no output" + (f" ({why[0]})" if why and why[0]
                                                               else ""))

    def start(self, grammar: str, after: str | None = None) -> Grammar:
        """A new matcher, held off until the output has written ``after`` when given
        (the text that closes the model's reasoning); ValueError naming the grammar's
        fault."""
        matcher = _llguidance().LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"grammar: not valid: {matcher.get_error()}")
        held = _Reasoning(after.encode(), self.tokenizer) if after else None
        return Grammar(matcher, self.vocab_size, held, self.eos_token_ids)


def markup_as_text(tokenizer_json: str) -> str:
    """The tokenizer as llguidance should read it. llguidance takes an added token shaped
    like ``<...>`` for a special one whatever its flag, so a model's markup that decodes
    as text (DeepSeek's ``</think>`` and ``<｜User｜>``, flagged non-special) could never
    be matched by a grammar's text: in a byte-level BPE tokenizer such tokens move into
    the vocabulary, spelled as the bytes they decode to. Other tokenizers as they are."""
    spec = json.loads(tokenizer_json)
    vocab = (spec.get("model") or {}).get("vocab")
    if (spec.get("decoder") or {}).get("type") != "ByteLevel" or not isinstance(vocab, dict):
        return tokenizer_json
    chars, kept = _byte_level_chars(), []
    for token in spec.get("added_tokens") or []:
        spelled = "".join(chars[b] for b in token["content"].encode())
        if token.get("special") or vocab.get(spelled, token["id"]) != token["id"]:
            kept.append(token)  # (a special token; or its text is another token's)
        else:
            vocab[spelled] = token["id"]
    if len(kept) == len(spec.get("added_tokens") or []):
        return tokenizer_json
    spec["added_tokens"] = kept
    return json.dumps(spec)


def _byte_level_chars() -> list[str]:
    """Byte -> the character byte-level BPE spells it with (GPT-2's table: printable
    Latin-1 bytes as themselves, the rest from U+0100 on)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


class Grammar:
    """One request's matcher, and how many of its output tokens it has read. With a
    reasoning phase (``held``) the matcher waits: the model's reasoning is free, and
    the grammar binds the tokens after the one that closes it (vLLM's order).

        output: reasoning ... </think> | answer tokens ──▶ the matcher, masks from here
    """

    def __init__(self, matcher: Any, vocab_size: int, held: _Reasoning | None = None,
                 eos_token_ids: tuple[int, ...] = ()):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)  # what may follow a complete one
        self.consumed = 0  # output tokens read (by the matcher, or by the reasoning scan)
        self.held = held  # None once the reasoning has closed (or when there is none)
        self.error: str | None = None  # why the matcher refused an output token

    def sync(self, output_token_ids: list[int]) -> None:
        """Read the outputs it has not seen yet (tokens carried in, or sampled)."""
        new = output_token_ids[self.consumed:]
        self.consumed = len(output_token_ids)
        if self.held is not None and new:
            new = self.held.after(new)
            if not self.held.open:
                self.held = None
        if new and self.matcher.is_stopped() and set(new) <= self.eos_token_ids:
            return  # the end of sequence after a complete grammar: what it allowed
        if new and not self.matcher.consume_tokens(new):
            self.error = self.matcher.get_error() or "refused"
            log.warning("grammar: output token(s) %s refused by the grammar: %s", new,
                        self.error)

    @property
    def active(self) -> bool:
        """The grammar binds the next token (no reasoning left open)."""
        return self.held is None

    @property
    def done(self) -> bool:
        """Nothing more may follow (the grammar is complete, or broken)."""
        return self.active and (self.matcher.is_stopped() or self.matcher.is_error())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The allowed next tokens into ``bitmask[row]`` (int32 words, bit i of word j
        = token 32 j + i); left as it is (all allowed) while the reasoning is open."""
        if not self.active:
            return
        v = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def fill_drafts(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> int:
        """The masks of the 1 + d positions a step verifies, into ``bitmask[first_row:
        first_row + 1 + d]``: the next token's, then the one after each draft, as
        ``fill`` would give them had the drafts been sampled; returns how many leading
        drafts the grammar accepts (n). Positions past n stay all allowed: draft n + 1
        is refused, so nothing after it is kept. Drafts the open reasoning reads are
        free (their positions all allowed), the grammar binds after the one closing it.
        The matcher goes forward through the drafts and back (it ends where it began).

            position:   0        1          ...  n            n + 1 ..
            mask after: outputs  + draft 1  ...  + draft n    (left all allowed)
        """
        free = 0  # drafts read while the reasoning is open
        if self.held is not None:
            scan = copy.copy(self.held)
            rest = scan.after(drafts)
            if scan.open:
                return len(drafts)
            free = len(drafts) - len(rest)
        bound = drafts[free:]
        n = 0 if self.matcher.is_error() else self.matcher.validate_tokens(bound)
        taken = 0  # drafts the matcher recorded (none past a completed grammar's end)
        for j in range(n + 1):
            if j:
                if self.matcher.is_stopped():  # complete: the EOS it validates after
                    n = j - 1  # records nothing; the request ends at its completion
                    break
                if not self.matcher.consume_token(bound[j - 1]):
                    raise AssertionError(f"grammar: a validated draft refused: "
                                         f"{bound[j - 1]}")
                taken = j
            v = bitmask[first_row + free + j]
            self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
        if taken and not self.matcher.rollback(taken):
            raise AssertionError(f"grammar: rollback of {taken} drafts refused")
        return free + n


class _Reasoning:
    """Watches an output's bytes for the text that closes its reasoning (whole tokens
    or pieces of it: tokenizers split ``</think>`` either way)."""

    def __init__(self, close: bytes, tokenizer: Any):
        self.close = close
        self.tokenizer = tokenizer
        self.open = True
        self._tail = b""  # the last bytes read, in case the text spans tokens

    def after(self, tokens: list[int]) -> list[int]:
        """The tokens after the one that completes the closing text ([] while none
        has)."""
        for k, token in enumerate(tokens):
            seen = self._tail + self.tokenizer.decode_bytes([token])
            if self.close in seen:
                self.open = False
                return tokens[k + 1:]
            self._tail = seen[max(0, len(seen) - len(self.close) + 1):]
        return []


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor
                  ) -> torch.Tensor:
    """``logits`` with -inf on each of ``rows``' forbidden tokens (``bitmask`` holds one
    row per entry of ``rows``); the other rows as they were."""
    import torch

    words = bitmask.to(logits.device)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :logits.shape[1]].bool()
    out = logits.clone()
    idx = torch.tensor(rows, device=logits.device)
    out[idx] = out[idx].masked_fill(~allowed, float("-inf"))
    return out


def new_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    import torch

    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)


# -- what clients send, as grammars (the gateway) ---------------------------------------
def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """A JSON schema's grammar; compact JSON (no whitespace between tokens: a model
    free to add any would be free to never stop)."""
    return _llguidance().LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False})


def regex_grammar(regex: str) -> str:
    return _llguidance().LLMatcher.grammar_from_regex(regex)


def choice_grammar(choices: list[str]) -> str:
    """Exactly one of ``choices``."""
    return regex_grammar("(" + "|".join(_escape(c) for c in choices) + ")")


def lark_grammar(grammar: str) -> str:
    """A Lark grammar as llguidance reads it; a GBNF one (``::=`` rules, as llama.cpp
    and vLLM's xgrammar backend take) converted first."""
    llg = _llguidance()
    if "::=" in grammar:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            grammar = gbnf_to_lark(grammar)
        except Exception as e:  # noqa: BLE001 (its errors are plain Exceptions)
            raise ValueError(f"not a valid GBNF grammar: {e}") from None
    return llg.LLMatcher.grammar_from_lark(grammar)


_REGEX_META = set("\\.+*?()|[]{}^$-&~#")


def _escape(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)
