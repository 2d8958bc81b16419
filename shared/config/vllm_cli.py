"""``parse_vllm_serve``: a whole ``vllm serve MODEL [flags...]`` command line, as pdmesh sees it.

    "A=1 vllm serve M \\⏎ --max_model_len 4096 --additional-config '{...}' 2>&1 | tee x"
      ──join `\\⏎` continuations──▶ shlex words (quotes removed, `# comment` dropped)
      ──leading NAME=VALUE words──▶ env      ──words after `|`, `;`, `&&`, `2>&1`──▶ ignored
      ──FLAGS table──▶ typed values ──EngineArgs──▶ parse_additional_config ──▶ VllmServeConfig

Flags are spelled as vLLM spells them: ``--flag value`` or ``--flag=value``, underscores
allowed (``--max_model_len``), ``--no-X`` for every boolean flag. A flag pdmesh implements
fills a ``VllmServeConfig`` field; a flag pdmesh only accepts for compatibility is listed
in ``accepted_without_effect``; any other flag is an error naming the closest known one.

This only parses and validates: values pdmesh's runtime cannot serve yet (data or tensor
parallel > 1) are accepted here and refused at service start-up.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdmesh.shared.config.engine_args import EngineArgs
from pdmesh.shared.config.json_flags import json_flag
from pdmesh.shared.config.parse import parse_additional_config
from pdmesh.shared.config.schema import AdditionalConfig

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


class VllmCommandError(ValueError):
    """The command line cannot be used; ``problems`` holds one line per bad flag."""

    def __init__(self, problems: list[str]) -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class Flag:
    """One ``vllm serve`` flag: how its value is read and where it goes.

    ``kind``: "bool" (no value; ``--no-X`` sets False), "int", "float", "str", "json" (a
    JSON object), "names" (one or more words). ``field``: the ``VllmServeConfig`` field it
    fills, None to check the value and drop it. ``effect`` False: accepted for vLLM
    compatibility, listed in ``accepted_without_effect``.
    """

    kind: str
    field: str | None = None
    effect: bool = True
    choices: tuple[str, ...] = ()


def _compat(kind: str, field_name: str | None = None) -> Flag:
    return Flag(kind, field_name, effect=False)


# Every flag pdmesh knows, by its canonical spelling. Implemented flags first, then the
# ones accepted without effect: those in the seed documents, then common `vllm serve` ones.
FLAGS: dict[str, Flag] = {
    "--served-model-name": Flag("names", "served_model_name"),
    "--max-model-len": Flag("int", "max_model_len"),
    "--max-num-batched-tokens": Flag("int", "max_num_batched_tokens"),
    "--max-num-seqs": Flag("int", "max_num_seqs"),
    "--block-size": Flag("int", "block_size"),
    "--gpu-memory-utilization": Flag("float", "gpu_memory_utilization"),
    "--dtype": Flag("str", "dtype", choices=DTYPES),
    "--seed": Flag("int", "seed"),
    "--enforce-eager": Flag("bool", "enforce_eager"),
    "--enable-prefix-caching": Flag("bool", "enable_prefix_caching"),
    "--tensor-parallel-size": Flag("int", "tensor_parallel_size"),
    "--data-parallel-size": Flag("int", "data_parallel_size"),
    "--enable-expert-parallel": Flag("bool", "enable_expert_parallel"),
    "--enable-eplb": Flag("bool", "enable_eplb"),
    "--eplb-config": Flag("json", "eplb_config"),
    "--scheduling-policy": Flag("str", "scheduling_policy", choices=("fcfs", "priority")),
    "--kv-transfer-config": Flag("json", "kv_transfer_config"),
    "--additional-config": Flag("str", "additional_config_text"),
    "--api-key": Flag("str", "api_key"),
    "--host": Flag("str", "host"),
    "--port": Flag("int", "port"),
    # accepted without effect; a field means the additional-config rules still read it
    "--speculative-config": _compat("json", "speculative_config"),
    "--data-parallel-size-local": _compat("int", "data_parallel_size_local"),
    "--pipeline-parallel-size": _compat("int", "pipeline_parallel_size"),
    "--quantization": _compat("str"),
    "--compilation-config": _compat("json"),
    "--async-scheduling": _compat("bool"),
    "--trust-remote-code": _compat("bool"),
    "--data-parallel-start-rank": _compat("int"),
    "--data-parallel-rank": Flag("int", "data_parallel_rank"),
    "--data-parallel-address": Flag("str", "data_parallel_address"),
    "--data-parallel-rpc-port": Flag("int", "data_parallel_rpc_port"),
    "--headless": _compat("bool"),
    "--api-server-count": _compat("int"),
    "--tokenizer-mode": _compat("str"),
    "--tool-call-parser": _compat("str"),
    "--enable-auto-tool-choice": _compat("bool"),
    "--reasoning-parser": _compat("str"),
    "--safetensors-load-strategy": _compat("str"),
    "--model-loader-extra-config": _compat("json"),
    "--disable-hybrid-kv-cache-manager": _compat("bool"),
    "--enable-sleep-mode": _compat("bool"),
    "--enable-return-routed-experts": _compat("bool"),
    "--weight-transfer-config": _compat("json"),
    "--enable-chunked-prefill": _compat("bool"),
    "--distributed-executor-backend": _compat("str"),
    "--kv-cache-dtype": _compat("str"),
    "--tokenizer": _compat("str"),
    "--trust-request-chat-template": _compat("bool"),
    "--chat-template": _compat("str"),
    "--max-logprobs": _compat("int"),
    "--disable-log-requests": _compat("bool"),
    "--disable-log-stats": _compat("bool"),
    "--enable-log-requests": _compat("bool"),
    "--uvicorn-log-level": _compat("str"),
    "--generation-config": _compat("str"),
    "--hf-overrides": _compat("json"),
    "--load-format": _compat("str"),
    "--download-dir": _compat("str"),
    "--revision": _compat("str"),
    "--swap-space": _compat("float"),
    "--cpu-offload-gb": _compat("float"),
    "--limit-mm-per-prompt": _compat("json"),
}

ALIASES = {"-tp": "--tensor-parallel-size", "-dp": "--data-parallel-size",
           "-pp": "--pipeline-parallel-size", "-q": "--quantization"}

_ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_SHELL_OPERATOR = re.compile(r"(\|\|?|&&?|;|\d*[<>].*|[<>].*)$")
_SHELL_VARIABLE = re.compile(r"\$(\w+)$|\$\{(\w+)\}$")


@dataclass(frozen=True)
class VllmServeConfig:
    """The effective configuration of one ``vllm serve`` command line.

    None means "not given: pdmesh's default". ``accepted_without_effect`` names, in order of
    appearance, the given flags pdmesh accepts for compatibility and ignores (their values
    were still checked); ``warnings`` holds the additional-config warnings and notes about
    shell text that was ignored.
    """

    model: str
    served_model_name: tuple[str, ...] = ()
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None
    gpu_memory_utilization: float | None = None
    dtype: str = "auto"
    seed: int | None = None
    enforce_eager: bool = False
    enable_prefix_caching: bool | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_rank: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    enable_eplb: bool = False
    eplb_config: Mapping[str, Any] = field(default_factory=dict)
    scheduling_policy: str = "fcfs"
    kv_transfer_config: Mapping[str, Any] = field(default_factory=dict)
    speculative_config: Mapping[str, Any] = field(default_factory=dict)
    additional_config: AdditionalConfig = field(default_factory=AdditionalConfig)
    api_key: str | None = None
    host: str | None = None
    port: int = 8000
    env: Mapping[str, str] = field(default_factory=dict)  # the NAME=VALUE prefix words
    accepted_without_effect: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def parse_vllm_serve(
    command: str,
    *,
    device: str = "cpu",
    env: Mapping[str, str] | None = None,
    variables: Mapping[str, str] | None = None,
) -> VllmServeConfig:
    """Parse ``[NAME=VALUE ...] vllm serve MODEL [flags...]`` as a shell would, then check it.

    ``env`` (default: empty) is the environment the deprecated additional-config variables
    are read from; the command's own ``NAME=VALUE`` prefix words override it. A flag value
    that is a lone shell variable (``$2``, ``${PORT}``) is looked up in ``variables``.

    Raises ``VllmCommandError`` (a ValueError) naming every bad flag, or ``ConfigError``
    naming every bad ``--additional-config`` key.
    """
    words = _shell_words(command)
    prefix_env: dict[str, str] = {}
    while words and _ENV_WORD.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        prefix_env[name] = value
    if words[:2] != ["vllm", "serve"]:
        raise VllmCommandError([f"expected a `vllm serve MODEL ...` command, got "
                                f"{' '.join(words[:2])!r}"])
    reading = _Reading(variables or {})
    reading.read(words[2:])
    if reading.problems:
        raise VllmCommandError(reading.problems)
    values = reading.values
    text = values.pop("additional_config_text", "{}")
    merged_env = {**(env or {}), **prefix_env}
    additional = parse_additional_config(text, env=merged_env, device=device,
                                         engine_args=_engine_args(values))
    warnings = list(additional.warnings)
    if reading.ignored:
        warnings.append(f"ignored shell text after the command: {' '.join(reading.ignored)}")
    return VllmServeConfig(**values, additional_config=additional, env=prefix_env,
                           accepted_without_effect=tuple(reading.compat),
                           warnings=tuple(warnings))


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
        raise VllmCommandError([f"cannot split the command line: {e}"]) from None


class _Reading:
    """One pass over the words after ``vllm serve``, collecting values and problems."""

    def __init__(self, variables: Mapping[str, str]) -> None:
        self.variables = variables
        self.values: dict[str, Any] = {}
        self.compat: list[str] = []  # accepted-without-effect flags, canonical spelling
        self.problems: list[str] = []
        self.ignored: list[str] = []  # a pipe, redirection or next command, and what follows

    def read(self, words: list[str]) -> None:
        i = 0
        while i < len(words):
            word = words[i]
            if _SHELL_OPERATOR.match(word):
                self.ignored = words[i:]
                break
            i = self._flag(words, i) if word.startswith("-") else self._positional(word, i)
        if "model" not in self.values and not self.problems:
            self.problems.append("vllm serve: the model (first positional argument) is missing")

    def _positional(self, word: str, i: int) -> int:
        if "model" in self.values:
            self.problems.append(f"{word!r}: unexpected argument (the model is "
                                 f"{self.values['model']!r})")
        else:
            self.values["model"] = word
        return i + 1

    def _flag(self, words: list[str], i: int) -> int:
        """Read the flag at ``words[i]`` and its value; the index of the next word."""
        written, has_inline, inline = words[i].partition("=")
        i += 1
        name, negated = _canonical(written)
        flag = FLAGS.get(name)
        if flag is None or (negated and flag.kind != "bool"):
            self.problems.append(_unknown(written))
            return i
        raw: list[str] = [inline] if has_inline else []
        if flag.kind == "bool" and has_inline:
            self.problems.append(f"{written}: takes no value, got {inline!r}")
            return i
        if flag.kind != "bool" and not has_inline:
            while i < len(words) and (not raw or (flag.kind == "names" and _is_value(words[i]))):
                raw.append(words[i])
                i += 1
            if not raw:
                self.problems.append(f"{written}: expects a value")
                return i
        try:
            value = (not negated) if flag.kind == "bool" else _convert(
                flag, [_expand(w, self.variables, written) for w in raw], written)
        except ValueError as e:
            self.problems.append(str(e))
            return i
        shown = f"--no-{name[2:]}" if negated else name
        if not flag.effect and shown not in self.compat:
            self.compat.append(shown)
        if flag.field is not None:
            self.values[flag.field] = value
        return i


def _is_value(word: str) -> bool:
    return not word.startswith("-") and not _SHELL_OPERATOR.match(word)


def _canonical(written: str) -> tuple[str, bool]:
    """``--max_model_len`` → (``--max-model-len``, False); ``--no-enforce-eager`` → (.., True)."""
    if written in ALIASES:
        return ALIASES[written], False
    if not written.startswith("--") or written.startswith("---"):
        return written, False
    name = "--" + written[2:].replace("_", "-")
    if name.startswith("--no-") and "--" + name[5:] in FLAGS:
        return "--" + name[5:], True
    return name, False


def _unknown(written: str) -> str:
    stripped = "--" + written.lstrip("-").replace("_", "-")
    if stripped != written and stripped in FLAGS and written.startswith("---"):
        return (f"{written}: unknown flag (too many leading dashes); "
                f"did you mean {stripped}?")
    known = [*FLAGS, *(f"--no-{n[2:]}" for n, f in FLAGS.items() if f.kind == "bool")]
    close = difflib.get_close_matches(stripped, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"{written}: not a vllm serve flag pdmesh knows{hint}"


def _expand(word: str, variables: Mapping[str, str], flag: str) -> str:
    """A lone ``$NAME`` / ``${NAME}`` value replaced from ``variables``."""
    m = _SHELL_VARIABLE.match(word)
    if m is None:
        return word
    name = m.group(1) or m.group(2)
    if name not in variables:
        raise ValueError(f"{flag}: {word!r} is an unexpanded shell variable; give its value")
    return variables[name]


_CONVERTERS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


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
        raise ValueError(f"{written}: must be one of {', '.join(flag.choices)}, got {value!r}")
    return value


def _engine_args(values: Mapping[str, Any]) -> EngineArgs:
    """The engine flags the additional-config rules read; kv_role from --kv-transfer-config."""
    kv_role = values.get("kv_transfer_config", {}).get("kv_role")
    speculative = values.get("speculative_config", {}).get("method")
    names = {f.name for f in dataclasses.fields(EngineArgs)} & set(values)
    try:
        return EngineArgs(kv_role=kv_role, speculative_method=speculative,
                          **{n: values[n] for n in names})
    except ValueError as e:
        raise VllmCommandError([str(e)]) from None
