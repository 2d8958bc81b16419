"""What a request's output must obey, as the engine's grammar (shared/engine/structured.py)
and logit bias: OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's
``structured_outputs`` and its older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``. At most one kind per request; a schema or regex
that cannot be compiled is a 400 naming its field, before anything is sent. vLLM's
``bad_words`` become the token sequences the engine's sampler bans.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from pdmesh.services.gateway.parsers import REASONING_PARSERS
from pdmesh.services.gateway.protocol import _Base
from pdmesh.shared.engine.structured import (
    check_grammar,
    choice_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)

log = logging.getLogger(__name__)

# vLLM's StructuredOutputsConfig keys that change nothing here (llguidance compiles every
# grammar, JSON without free whitespace)
_CONFIG_WITHOUT_EFFECT = ("disable_fallback", "disable_any_whitespace",
                          "disable_additional_properties", "reasoning_parser_plugin")
_BACKENDS = ("auto", "guidance", "xgrammar", "outlines", "lm-format-enforcer")


def grammar_in_reasoning(config: dict[str, Any] | None) -> bool:
    """--structured-outputs-config as vLLM reads it: whether a grammar binds the model's
    reasoning too (``enable_in_reasoning``). ValueError naming a key it cannot take; a
    warning for the keys and backends without effect here."""
    config = dict(config or {})
    known = {"backend", "enable_in_reasoning", "reasoning_parser", *_CONFIG_WITHOUT_EFFECT}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"--structured-outputs-config: unknown key(s) {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(known))})")
    backend = config.get("backend", "auto")
    if backend not in _BACKENDS:
        raise ValueError(f"--structured-outputs-config: backend must be one of "
                         f"{', '.join(_BACKENDS)}, got {backend!r}")
    ignored = [k for k in _CONFIG_WITHOUT_EFFECT if k in config]
    if backend not in ("auto", "guidance"):
        ignored.append(f"backend {backend!r}")
    if ignored:
        log.warning("--structured-outputs-config: %s without effect (llguidance compiles "
                    "every grammar here)", ", ".join(ignored))
    flag = config.get("enable_in_reasoning", False)
    if not isinstance(flag, bool):
        raise ValueError(f"--structured-outputs-config: enable_in_reasoning must be true or "
                         f"false, got {flag!r}")
    return flag


def reasoning_parser_named(config: dict[str, Any] | None, flag: str | None) -> str | None:
    """--reasoning-parser, or --structured-outputs-config's reasoning_parser (vLLM's flag
    fills that key: either spelling names the parser). ValueError when they differ or
    the key names no parser."""
    named = (config or {}).get("reasoning_parser")
    if named is None or named == flag:
        return flag
    if flag is not None:
        raise ValueError(f"--structured-outputs-config: reasoning_parser {named!r} is not "
                         f"--reasoning-parser's {flag!r}")
    if named not in REASONING_PARSERS:
        raise ValueError(f"--structured-outputs-config: reasoning_parser must be one of "
                         f"{', '.join(REASONING_PARSERS)}, got {named!r}")
    return named


def grammar_for(body: _Base, accepts: Callable[[str], None] | None = None) -> str | None:
    """The grammar the output obeys (None: free). ValueError "field: why"; ``accepts``
    (``GrammarCompiler.check_accepts``): raises for a grammar that accepts nothing."""
    asked = _asked(body)
    if len(asked) > 1:
        raise ValueError(f"{asked[1][0]}: one kind of structured output per request; "
                         f"{', '.join(name for name, _ in asked)} were given")
    if not asked:
        return None
    field, make = asked[0]
    try:
        grammar = make()
        check_grammar(grammar)
        if accepts is not None:
            accepts(grammar)
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
    return grammar


def wants_grammar(body: _Base) -> bool:
    return bool(_asked(body))


def _asked(body: _Base) -> list[tuple[str, Any]]:
    """(field, the grammar's maker) for each kind of structured output asked for."""
    out: list[tuple[str, Any]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        out.append(("response_format", lambda: json_schema_grammar({"type": "object"})))
    elif fmt is not None and fmt.type == "json_schema":
        spec = fmt.json_schema or {}
        if not isinstance(spec.get("schema"), dict):  # (OpenAI's shape: json_schema.schema)
            raise ValueError("response_format.json_schema.schema: must be a JSON schema "
                             "(an object)")
        out.append(("response_format", lambda: json_schema_grammar(spec["schema"])))
    so = body.structured_outputs
    if so is not None:
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex),
                                     ("choice", so.choice), ("grammar", so.grammar),
                                     ("json_object", so.json_object or None))
                 if v is not None]
        out += [(f"structured_outputs.{k}", _maker(k, v)) for k, v in given]
    for k in ("json", "regex", "choice", "grammar"):
        v = getattr(body, f"guided_{k}")
        if v is not None:
            out.append((f"guided_{k}", _maker(k, v)))
    return out


def _maker(kind: str, value: Any) -> Any:
    if kind == "json":
        return lambda: json_schema_grammar(_schema(value))
    if kind == "json_object":
        return lambda: json_schema_grammar({"type": "object"})
    if kind == "regex":
        return lambda: regex_grammar(value)
    if kind == "choice":
        return lambda: choice_grammar(value)
    return lambda: lark_grammar(value)


def _schema(value: dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except ValueError as e:
        raise ValueError(f"not a JSON schema ({e})") from None
    if not isinstance(schema, dict):
        raise ValueError("not a JSON schema (an object)")
    return schema


def logit_bias_for(body: _Base, vocab_size: int) -> dict[int, float]:
    """``logit_bias`` by token id (JSON keys are strings). ValueError naming a key that
    is not a token id of this vocabulary."""
    out: dict[int, float] = {}
    for key, bias in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ValueError(f"logit_bias: {key!r} is not a token id") from None
        if not 0 <= token < vocab_size:
            raise ValueError(f"logit_bias: token id {token} is outside the vocabulary "
                             f"[0, {vocab_size})")
        out[token] = bias
    return out


def bad_words_token_ids(words: list[str], tokenizer: Any) -> list[list[int]]:
    """``bad_words`` as the token sequences the engine bans, as vLLM tokenizes them: each
    word (its leading spaces stripped) as it is, and with a leading space where that
    spells it with as many tokens starting with another one (the word inside a text)."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise ValueError(f"bad_words: {word!r} has no tokens to ban")
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(bare)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    return out


def tool_grammar(output: Any, body: Any, accepts: Callable[[str], None] | None = None
                 ) -> str | None:
    """The grammar a forced tool choice needs (``ChatOutput.grammar``), checked: a tool's
    parameters that are not a usable schema (or accept nothing) are a 400 naming the
    tools."""
    try:
        grammar = output.grammar(body)
        if grammar is not None:
            check_grammar(grammar)
            if accepts is not None:
                accepts(grammar)
    except ValueError as e:
        raise ValueError(f"tools: {e}") from None
    return grammar
