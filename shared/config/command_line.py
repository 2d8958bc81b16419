"""Reads a command's words with the flag table (``flags``), the way vLLM's parser does.

    pdmesh decode MODEL --max_model_len 4096 --no-enable-prefix-caching -tp 1 ...
      ──▶ Flags: every flag of the command as an attribute (its default when not given)

``--flag value`` or ``--flag=value``; underscores for dashes (``--max_model_len``, as
vLLM's FlexibleArgumentParser allows); ``--no-X`` for every boolean flag; aliases
(``-tp``, SGLang's ``--tp-size``). The model comes first positionally (``vllm serve
MODEL``) or as ``--model``. Every problem is collected - an unknown flag with the closest
known one, a value of the wrong type, a flag without its value - and raised together as
one ``FlagError`` naming each flag.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterable
from typing import Any

from pdmesh.shared.config.flags import FLAGS, MODEL_COMMANDS, Flag, flags_for
from pdmesh.shared.config.json_flags import json_flag

# commands that cannot run without a model (up and serve make the demo one)
MODEL_REQUIRED = MODEL_COMMANDS - {"up", "serve", "config check"}


class FlagError(ValueError):
    """The command line cannot be used; ``problems`` holds one line per bad flag."""

    def __init__(self, problems: list[str]) -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        super().__init__("\n".join(self.problems))


class HelpRequested(Exception):
    """``-h`` / ``--help``: print ``help_text(command)`` instead of running."""


class Flags:
    """What a command line said. Every flag the command takes is an attribute holding
    its value (the default when not given); ``given`` lists the flags written, in order,
    canonically spelled, and ``shown`` how to name each one (``--no-X`` for a False)."""

    def __init__(self, command: str, values: dict[str, Any]):
        self.command = command
        self.given: list[str] = []
        self.shown: dict[str, str] = {}
        for name, value in values.items():
            setattr(self, name, value)

    def __repr__(self) -> str:
        return f"Flags({self.command}: {', '.join(self.given)})"

    def values(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k not in ("command", "given", "shown")}

    @property
    def without_effect(self) -> list[str]:
        """Flags given that do nothing in this command, as written (vLLM compatibility)."""
        return [self.shown[n] for n in self.given if not _FLAG[n].acts_in(self.command)]


# values upstream takes that pdmesh refuses, with the reason the refusal gives
REFUSED_VALUES = {
    ("--reasoning-parser", "gpt-oss"): "gpt-oss writes its reasoning in OpenAI's harmony "
    "channels, and pdmesh does not load gpt-oss checkpoints",
    ("--reasoning-parser", "gpt_oss"): "gpt-oss writes its reasoning in OpenAI's harmony "
    "channels, and pdmesh does not load gpt-oss checkpoints",
}

_FLAG = {f.name: f for f in FLAGS}


def parse_command_line(command: str, words: list[str]) -> Flags:
    """The command's flags from ``words`` (what follows the command); FlagError naming
    every problem, HelpRequested for -h / --help."""
    reading = _Reading(command)
    reading.read(words)
    if reading.problems:
        raise FlagError(reading.problems)
    return reading.flags


class _Reading:
    """One pass over the words, collecting values and problems."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.known = flags_for(command)
        self.flags = Flags(command, {f.attr: f.default_for(command)
                                     for f in set(self.known.values())})
        self.problems: list[str] = []
        self.model_word: str | None = None

    def read(self, words: list[str]) -> None:
        i = 0
        while i < len(words):
            word = words[i]
            if word in ("-h", "--help"):
                raise HelpRequested(self.command)
            if word.startswith("-") and word != "-" and not _is_number(word):
                i = self._flag(words, i)
            else:
                self._positional(word)
                i += 1
        self._settle_model()

    def _positional(self, word: str) -> None:
        if "--model" not in self.known:
            self.problems.append(f"{word!r}: unexpected argument")
        elif self.model_word is not None:
            self.problems.append(f"{word!r}: unexpected argument (the model is "
                                 f"{self.model_word!r})")
        else:
            self.model_word = word

    def _settle_model(self) -> None:
        if "--model" not in self.known:
            return
        given = self.flags.model if "--model" in self.flags.given else None
        if self.model_word is not None and given is not None and given != self.model_word:
            self.problems.append(f"model: given twice, as {self.model_word!r} and --model "
                                 f"{given!r}")
        elif self.model_word is not None:
            self.flags.model = self.model_word
            self._mark("--model", "--model")
        if self.command in MODEL_REQUIRED and not self.flags.model and not self.problems:
            self.problems.append(f"model: required (pdmesh {self.command} MODEL ... or "
                                 "--model MODEL)")

    def _flag(self, words: list[str], i: int) -> int:
        """Read the flag at ``words[i]`` and its value; the index of the next word."""
        written, has_inline, inline = words[i].partition("=")
        i += 1
        flag, negated = self._lookup(written)
        if flag is None:
            self.problems.append(_unknown(written, self.known))
            return i
        if flag.kind == "bool":
            if has_inline:
                self.problems.append(f"{written}: takes no value, got {inline!r}")
                return i
            self._set(flag, not negated, f"--no-{flag.name[2:]}" if negated else flag.name)
            return i
        raw = [inline] if has_inline else []
        while i < len(words) and (not raw or (flag.kind == "names" and _is_value(words[i]))):
            if not raw and not has_inline and words[i].startswith("--") and \
                    words[i].split("=")[0] in self.known:
                break  # the next word is a flag: this one has no value
            raw.append(words[i])
            i += 1
        if not raw:
            self.problems.append(f"{written}: expects a value")
            return i
        try:
            value = _convert(flag, raw, written)
        except ValueError as e:
            self.problems.append(str(e))
            return i
        if flag.kind == "list":
            value = [*getattr(self.flags, flag.attr), *value]
        self._set(flag, value, flag.name)
        return i

    def _lookup(self, written: str) -> tuple[Flag | None, bool]:
        """The flag a spelling names (underscores as dashes), and whether it is --no-X."""
        if written in self.known:
            return self.known[written], False
        if not written.startswith("--") or written.startswith("---"):
            return None, False
        name = "--" + written[2:].replace("_", "-")
        if name in self.known:
            return self.known[name], False
        if name.startswith("--no-"):
            flag = self.known.get("--" + name[5:])
            if flag is not None and flag.kind == "bool":
                return flag, True
        return None, False

    def _set(self, flag: Flag, value: Any, shown: str) -> None:
        setattr(self.flags, flag.attr, value)
        self._mark(flag.name, shown)

    def _mark(self, name: str, shown: str) -> None:
        if name not in self.flags.shown:
            self.flags.given.append(name)
        self.flags.shown[name] = shown


def _is_number(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False


def _is_value(word: str) -> bool:
    return not word.startswith("-") or _is_number(word)


def _unknown(written: str, known: dict[str, Flag]) -> str:
    stripped = "--" + written.lstrip("-").replace("_", "-")
    if stripped != written and stripped in known and written.startswith("---"):
        return f"{written}: unknown flag (too many leading dashes); did you mean {stripped}?"
    spellings = [*known, *(f"--no-{f.name[2:]}" for f in set(known.values())
                           if f.kind == "bool")]
    close = difflib.get_close_matches(stripped, spellings, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"{written}: not a flag pdmesh knows here{hint}"


_CONVERTERS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str,
                                                "list": str}


def _convert(flag: Flag, raw: list[str], written: str) -> Any:
    if flag.kind == "names":
        return tuple(raw)
    if flag.kind == "json":
        return json_flag(written, raw[0])
    try:
        value = _CONVERTERS[flag.kind](raw[0])
    except ValueError:
        raise ValueError(f"{written}: expected {'an' if flag.kind == 'int' else 'a'} "
                         f"{flag.kind}, got {raw[0]!r}") from None
    if flag.choices and value not in flag.choices:
        why = REFUSED_VALUES.get((flag.name, value))
        raise ValueError(f"{written}: must be one of "
                         f"{', '.join(str(c) for c in flag.choices)}, got {value!r}"
                         + (f" ({why})" if why else ""))
    return [value] if flag.kind == "list" else value


def to_words(flags: Flags, names: Iterable[str]) -> list[str]:
    """The words that give ``names`` (those of them written) their values again: how a
    launcher hands its flags on to the services it starts."""
    words: list[str] = []
    for name in names:
        if name not in flags.shown:
            continue
        flag = _FLAG[name]
        value = getattr(flags, flag.attr)
        if flag.kind == "bool":
            words.append(name if value else f"--no-{name[2:]}")
        elif flag.kind == "names":
            words += [name, *value]
        elif flag.kind == "list":
            for v in value:
                words += [name, str(v)]
        elif flag.kind == "json":
            words += [name, json.dumps(value)]
        elif value is not None:
            words += [name, str(value)]
    return words


def help_text(command: str, about: str = "") -> str:
    """Every flag the command takes, the ones without effect last."""
    known = sorted(set(flags_for(command).values()), key=lambda f: f.name)
    lines = [f"usage: pdmesh {command}"
             + (" [MODEL]" if "--model" in flags_for(command) else "") + " [flags]"]
    if about:
        lines += ["", about]
    for title, group in (("flags", [f for f in known if f.acts_in(command)]),
                         ("accepted without effect (vLLM compatibility)",
                          [f for f in known if not f.acts_in(command)])):
        if not group:
            continue
        lines += ["", f"{title}:"]
        for f in group:
            default = f.default_for(command)
            negation = (f"--no-{f.name[2:]}",) if f.kind == "bool" else ()
            names = ", ".join((f.name, *negation, *f.aliases))
            value = "" if f.kind == "bool" else f" {f.kind.upper()}"
            extra = "" if default in (None, "", (), [], False) else \
                " (default: on)" if default is True else f" (default: {default})"
            lines.append(f"  {names}{value}\n      {f.help}{extra}")
    return "\n".join(lines) + "\n"
