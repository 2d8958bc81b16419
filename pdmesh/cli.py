"""The `pdmesh` command. Each command lives in a module of its own; only the chosen one
is imported, so a probe like `pdmesh health` starts in milliseconds, not after torch.

The services and every command that runs or checks an engine read their flags from the
one flag table (``pdmesh.shared.config.flags``) into a ServeConfig (``serve_config``);
their module's ``run(config)`` gets it. The tools (status, health, the HTTP and KV
benchmarks, make-tiny-model) keep argparse: ``add_args(parser)`` and ``run(args)``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any

from pdmesh.shared.config.command_line import FlagError, HelpRequested, help_text
from pdmesh.shared.config.errors import ConfigError


@dataclass(frozen=True)
class Command:
    words: tuple[str, ...]
    module: str
    help: str
    table: bool  # flags from the table (a ServeConfig), else argparse

    @property
    def name(self) -> str:
        return " ".join(self.words)


COMMANDS = [
    Command(("make-tiny-model",), "pdmesh.shared.cli.make_tiny_model",
            "write a random model + locally trained tokenizer", False),
    Command(("quantize",), "pdmesh.shared.cli.quantize",
            "write a quantized copy of a checkpoint (modelslim W8A8 / W8A8_DYNAMIC / "
            "W4A8_DYNAMIC, DeepSeek FP8 block)", False),
    Command(("generate",), "pdmesh.shared.cli.generate", "offline generation with the engine",
            True),
    Command(("bench", "offline"), "pdmesh.shared.cli.bench.offline",
            "batch and single-request throughput vs transformers", True),
    Command(("bench", "serve"), "pdmesh.shared.cli.bench.serve",
            "load an OpenAI endpoint like `vllm bench serve`", False),
    Command(("bench", "eplb"), "pdmesh.shared.cli.bench.eplb",
            "expert-parallel decode with EPLB off vs on, skewed vs balanced", False),
    Command(("bench", "dyntralb"), "pdmesh.shared.cli.bench.dyntralb",
            "lockstep DP decode with DyntraLB off vs on (vLLM-Ascend's planner)",
            False),
    Command(("bench", "quantization"), "pdmesh.shared.cli.bench.quantization",
            "decode and batch speed of float32 / bfloat16 / each quantized scheme", False),
    Command(("bench", "tensor-parallel"), "pdmesh.shared.cli.bench.tensor_parallel",
            "decode and batch speed at TP 1 vs TP N, and where a TP step's time goes",
            False),
    Command(("bench", "kv-transfer"), "pdmesh.shared.cli.bench.kv_transfer",
            "KV put/get throughput through the pool", False),
    Command(("kvstore",), "pdmesh.services.kvstore.main",
            "the KV pool service: Mooncake master + pool index", True),
    Command(("prefill",), "pdmesh.services.prefill.main", "a prefill instance (gRPC)", True),
    Command(("decode",), "pdmesh.services.decode.main", "a decode instance (gRPC, streaming)",
            True),
    Command(("mixed",), "pdmesh.services.decode.main",
            "a mixed prefill+decode instance (gRPC, no KV pool)", True),
    Command(("gateway",), "pdmesh.services.gateway.main", "the OpenAI-compatible HTTP gateway",
            True),
    Command(("eplb",), "pdmesh.services.eplb.main", "the EPLB controller (gRPC)", True),
    Command(("up",), "pdmesh.shared.cli.up", "the whole mesh as local processes", True),
    Command(("serve",), "pdmesh.shared.cli.up",
            "vllm serve's command line: one mixed instance behind the gateway", True),
    Command(("sglang",), "pdmesh.shared.cli.sglang",
            "SGLang's launch_server command line: serve, or a prefill / decode instance",
            True),
    Command(("sglang-router",), "pdmesh.services.gateway.main",
            "SGLang's router command line (launch_router --pd-disaggregation): the gateway",
            True),
    Command(("proxy",), "pdmesh.services.gateway.main",
            "vLLM-Ascend's PD proxy line (--prefiller-hosts/-ports, --decoder-hosts/-ports): "
            "the gateway, dialling the instances it names", True),
    Command(("health",), "pdmesh.shared.cli.health", "probe a service (for healthchecks)",
            False),
    Command(("status",), "pdmesh.shared.cli.status", "live instances, pool and EPLB at a glance",
            False),
    Command(("cluster-secret",), "pdmesh.shared.cli.cluster_secret",
            "make the mesh's shared secret once (a file, or a Kubernetes Secret)", False),
    Command(("selftest",), "pdmesh.shared.cli.selftest",
            "this machine's device kernels against the reference, then a tiny model served "
            "through PD on it: a table for a bug report", False),
    Command(("config", "check"), "pdmesh.shared.cli.config_check",
            "what a service would run with these flags, or every error in them", True),
]


class UsageError(Exception):
    """The command line is wrong: each line a problem, exit status 2."""


def _global_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdmesh", description=__doc__, add_help=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--log-format", default="text", choices=("text", "json"))
    return p


def usage() -> str:
    lines = ["usage: pdmesh [--log-level LEVEL] [--log-format text|json] COMMAND ...",
             "       pdmesh --version", "",
             "commands:"]
    lines += [f"  {c.name:<18} {c.help}" for c in COMMANDS]
    return "\n".join(lines) + "\n"


def _split(argv: list[str]) -> tuple[argparse.Namespace, Command | None, list[str]]:
    """Global options, the command, and the words after it."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] in ("--log-level", "--log-format") else 1
    options = _global_parser().parse_args(argv[:i])
    for words in ((tuple(argv[i:i + 2])), (tuple(argv[i:i + 1]))):
        command = next((c for c in COMMANDS if c.words == words), None)
        if command is not None:
            return options, command, argv[i + len(words):]
    if i < len(argv) and not options.help:
        known = sorted({c.words[0] for c in COMMANDS})
        raise UsageError(f"{' '.join(argv[i:i + 2])!r}: not a command (one of "
                         f"{', '.join(known)})")
    return options, None, []


def parse_args(argv: list[str], resolve: bool = True) -> tuple[argparse.Namespace,
                                                               Command, Any]:
    """The global options, the command, and its configuration: a ServeConfig (with
    ``resolve`` False only its Flags, as read), or argparse's Namespace for the tools.
    SystemExit(2) with the problems on stderr, as argparse does, when the command line is
    wrong; SystemExit(0) after printing the help."""
    try:
        options, command, rest = _split(argv)
        if command is None:
            print(usage(), end="")
            raise SystemExit(0)
        config = _parse(command, rest, resolve)
    except HelpRequested as h:
        about = next((c.help for c in COMMANDS if c.name == str(h)), "")
        print(help_text(str(h), about), end="")
        raise SystemExit(0) from None
    except (UsageError, FlagError, ConfigError, ValueError) as e:
        for problem in _problems(e):
            print(f"pdmesh: error: {problem}", file=sys.stderr)
        raise SystemExit(2) from None
    return options, command, config


def _parse(command: Command, rest: list[str], resolve: bool) -> Any:
    if command.table:
        from pdmesh.shared.config.command_line import parse_command_line
        from pdmesh.shared.config.serve import serve_config

        return serve_config(command.name, rest) if resolve else \
            parse_command_line(command.name, rest)
    parser = argparse.ArgumentParser(prog=f"pdmesh {command.name}", description=command.help)
    module = importlib.import_module(command.module)
    module.add_args(parser)
    parser.add_argument("--log-level", default=argparse.SUPPRESS)
    parser.add_argument("--log-format", default=argparse.SUPPRESS, choices=("text", "json"))
    _model_positional(parser)
    args = parser.parse_args(rest)
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            parser.error(f"model: given twice, as {tag!r} and --model {args.model!r}")
        args.model = tag
    if getattr(args, "model_required", False) and not args.model:
        parser.error("model: required (pdmesh COMMAND MODEL ... or --model MODEL)")
    return args


def _model_positional(cmd: argparse.ArgumentParser) -> None:
    """A tool with ``--model`` takes the model positionally too, as ``vllm serve MODEL``."""
    flag = next((a for a in cmd._actions if "--model" in a.option_strings), None)
    if flag is None:
        return
    if flag.required:
        flag.required = False
        cmd.set_defaults(model_required=True)
    cmd.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="the model, as `vllm serve MODEL` takes it (or --model)")


def _bind_natively(argv: list[str]) -> None:
    """For a command in BOUND: native libraries bind --host too (shared.infra.bindhost);
    may re-execute this process (with ``argv``: an SGLang line already rewritten). A bad
    command line is left to parse_args to report."""
    try:
        _, command, rest = _split(argv)
        if command is None or command.name not in BOUND:
            return
        from pdmesh.shared.config.command_line import parse_command_line

        host = parse_command_line(command.name, rest).host
    except (UsageError, FlagError, HelpRequested, ValueError, SystemExit):
        return
    from pdmesh.shared.infra.bindhost import ensure_bound

    ensure_bound(host, argv)


def _log_settings(options: argparse.Namespace, command: Command, config: Any
                  ) -> tuple[str, str]:
    """--log-level / --log-format, given before the command or after it (where users of
    vllm serve and sglang put them; after wins)."""
    if command.table:
        written = config.flags.given
        return (config.log_level if "--log-level" in written else options.log_level,
                config.log_format if "--log-format" in written else options.log_format)
    return (getattr(config, "log_level", options.log_level),
            getattr(config, "log_format", options.log_format))


def _problems(e: Exception) -> list[str]:
    problems = getattr(e, "problems", None)
    return [str(p) for p in problems] if problems else [str(e)]


# commands whose processes run native listeners (Mooncake, torch.distributed)
BOUND = frozenset({"kvstore", "prefill", "decode", "mixed"})


def entry() -> None:
    """The `pdmesh` process (the console script, ``python -m pdmesh``): main's exit code;
    past Mooncake's teardown of a master that went away (``exit_past_abandoned``)."""
    code = main()
    if (pool := sys.modules.get("pdmesh.shared.kvpool.mooncake")) is not None:
        pool.exit_past_abandoned(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--version"]:  # as `vllm --version`
        from importlib.metadata import version

        print(version("pdmesh"))
        return 0
    try:
        argv = _translated_line(argv)
    except ValueError as e:
        print(f"pdmesh: error: {e}", file=sys.stderr)
        return 2
    _bind_natively(argv)
    options, command, config = parse_args(argv)
    from pdmesh.shared.infra.logs import setup_logging

    setup_logging(*_log_settings(options, command, config))
    if command.table and command.name != "config check":
        config.log_warnings()
    secret_file = getattr(config, "cluster_secret_file", None)
    if secret_file:  # the whole process (and its children) use it
        os.environ["PDMESH_CLUSTER_SECRET_FILE"] = secret_file
    tls_dir = getattr(config, "tls_dir", None)
    if tls_dir:
        os.environ["PDMESH_TLS_DIR"] = tls_dir
    try:
        from pdmesh.shared.infra import cluster_auth, tls

        cluster_auth.secret()  # a bad secret stops the service before it serves
        tls.files()  # as do missing certificates
        return importlib.import_module(command.module).run(config)
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        for problem in _problems(e):
            print(f"pdmesh: error: {problem}", file=sys.stderr)
        return 2


def _translated_line(argv: list[str]) -> list[str]:
    """`pdmesh sglang ...` / `pdmesh sglang-router ...` / `pdmesh proxy ...` rewritten into
    the pdmesh command they describe."""
    try:
        options, command, rest = _split(argv)
    except UsageError:
        return argv
    if command is None or command.words not in (("sglang",), ("sglang-router",), ("proxy",)):
        return argv
    from pdmesh.services.gateway.proxy_line import translate_proxy
    from pdmesh.shared.cli.sglang import translate, translate_router

    name = command.words[0]
    line, warnings = {"sglang": translate, "sglang-router": translate_router,
                      "proxy": translate_proxy}[name](rest)
    for warning in warnings:
        print(f"pdmesh {name}: {warning}", file=sys.stderr)
    return [*argv[:len(argv) - len(rest) - 1], *line]


if __name__ == "__main__":
    sys.exit(main())
