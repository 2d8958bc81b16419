"""``parse_vllm_serve``: a whole ``vllm serve MODEL [flags...]`` command line, read by the
same parser the services use.

    "A=1 vllm serve M \\⏎ --max_model_len 4096 --additional-config '{...}' 2>&1 | tee x"
      ──join `\\⏎` continuations──▶ shlex words (quotes removed, `# comment` dropped)
      ──leading NAME=VALUE words──▶ env      ──words after `|`, `;`, `&&`, `2>&1`──▶ ignored
      ──$VARS from ``variables``──▶ parse_command_line("config check", ...) ──read_config──▶
      ServeConfig (the instance's role from the kv_role)

This reads and checks the line together (flags, --additional-config and its rules);
``resolve`` then says what pdmesh would run, refusing what it cannot run yet (tensor
parallelism > 1, for one) - `pdmesh config check --vllm-command` does both.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Mapping

from pdmesh.shared.config.command_line import FlagError, parse_command_line
from pdmesh.shared.config.flags import flags_for
from pdmesh.shared.config.serve import ServeConfig, read_config

VllmCommandError = FlagError  # (its name before one parser read every command line)
FLAGS = flags_for("config check")  # every spelling a vllm serve line may use

_ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_SHELL_OPERATOR = re.compile(r"(\|\|?|&&?|;|\d*[<>].*|[<>].*)$")
_SHELL_VARIABLE = re.compile(r"\$(\w+)$|\$\{(\w+)\}$")


def parse_vllm_serve(command: str, *, device: str = "cpu",
                     env: Mapping[str, str] | None = None,
                     variables: Mapping[str, str] | None = None) -> ServeConfig:
    """Read ``[NAME=VALUE ...] vllm serve MODEL [flags...]`` as a shell would, then check it.

    ``env`` (default: empty) is the environment the deprecated additional-config variables
    are read from; the command's own ``NAME=VALUE`` prefix words override it. A flag value
    that is a lone shell variable (``$2``, ``${PORT}``) is looked up in ``variables``.

    Raises FlagError (a ValueError) naming every bad flag, or ConfigError naming every
    bad ``--additional-config`` key.
    """
    words = _shell_words(command)
    prefix_env: dict[str, str] = {}
    while words and _ENV_WORD.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        prefix_env[name] = value
    if words[:2] != ["vllm", "serve"]:
        raise FlagError([f"expected a `vllm serve MODEL ...` command, got "
                         f"{' '.join(words[:2])!r}"])
    words = words[2:]
    ignored = next((words[i:] for i, w in enumerate(words) if _SHELL_OPERATOR.match(w)), [])
    words = words[:len(words) - len(ignored)]
    words, problems = _expand(words, variables or {})
    try:
        flags = parse_command_line("config check", words)
    except FlagError as e:
        problems += e.problems
    if problems:
        raise FlagError(problems)
    if not flags.model:
        raise FlagError(["vllm serve: the model (first positional argument) is missing"])
    config = read_config(flags, device=device, env={**(env or {}), **prefix_env})
    warnings = list(config.warnings)
    if ignored:
        warnings.append(f"ignored shell text after the command: {' '.join(ignored)}")
    return dataclasses.replace(config, env=prefix_env, warnings=tuple(warnings))


def _shell_words(command: str) -> list[str]:
    """The words as the shell splits them: `\\⏎` joins lines, quotes go, `# ...` is dropped.

    Unlike bash, a `\\⏎` inside single quotes is joined too, and `#` starts a comment
    inside a word as well (shlex's rule).
    """
    joined = re.sub(r"\\\r?\n", "", command)
    lexer = shlex.shlex(joined, posix=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return list(lexer)
    except ValueError as e:  # shlex: "No closing quotation" / "No escaped character"
        raise FlagError([f"cannot split the command line: {e}"]) from None


def _expand(words: list[str], variables: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """Lone ``$NAME`` / ``${NAME}`` values replaced from ``variables``; a flag whose value
    is a variable without one is dropped, with a problem naming it."""
    out: list[str] = []
    problems: list[str] = []
    for word in words:
        flag, eq, value = word.partition("=") if word.startswith("--") else ("", "", word)
        m = _SHELL_VARIABLE.match(value if eq else word)
        if m is None:
            out.append(word)
            continue
        name = m.group(1) or m.group(2)
        if name in variables:
            out.append(f"{flag}={variables[name]}" if eq else variables[name])
            continue
        written = flag if eq else (out.pop() if out and out[-1].startswith("-") else word)
        problems.append(f"{written}: {m.group(0)!r} is an unexpanded shell variable; give "
                        "its value")
    return out, problems
