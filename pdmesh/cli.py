"""`pdmesh` command line. Each command lives in its own module, exposing
``add_args(parser)`` and ``run(args)``; only the chosen command's module is imported, so
a probe like `pdmesh health` starts in milliseconds, not after importing torch."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any

# (command words, module, help, keyword arguments for run)
COMMANDS: list[tuple[tuple[str, ...], str, str, dict[str, Any]]] = [
    (("make-tiny-model",), "pdmesh.shared.models.tiny",
     "write a random model + locally trained tokenizer", {}),
    (("generate",), "pdmesh.shared.cli.generate", "offline generation with the engine", {}),
    (("bench", "offline"), "pdmesh.shared.cli.bench.offline",
     "batch and single-request throughput vs transformers", {}),
    (("bench", "serve"), "pdmesh.shared.cli.bench.serve",
     "load an OpenAI endpoint like `vllm bench serve`", {}),
    (("bench", "eplb"), "pdmesh.shared.cli.bench.eplb",
     "expert-parallel decode with EPLB off vs on, skewed vs balanced", {}),
    (("bench", "kv-transfer"), "pdmesh.shared.cli.bench.kv_transfer",
     "KV put/get throughput through the pool", {}),
    (("kvstore",), "pdmesh.services.kvstore.main",
     "the KV pool service: Mooncake master + pool index", {}),
    (("prefill",), "pdmesh.services.prefill.main", "a prefill instance (gRPC)", {}),
    (("decode",), "pdmesh.services.decode.main", "a decode instance (gRPC, streaming)", {}),
    (("mixed",), "pdmesh.services.decode.main",
     "a mixed prefill+decode instance (gRPC, no KV pool)", {"role": "mixed"}),
    (("gateway",), "pdmesh.services.gateway.main", "the OpenAI-compatible HTTP gateway", {}),
    (("eplb",), "pdmesh.services.eplb.main", "the EPLB controller (gRPC)", {}),
    (("up",), "pdmesh.shared.cli.up", "the whole mesh as local processes", {}),
    (("serve",), "pdmesh.shared.cli.up", "one mixed instance behind the gateway (single box)",
     {"mixed": True}),
    (("health",), "pdmesh.shared.cli.health", "probe a service (for healthchecks)", {}),
    (("status",), "pdmesh.shared.cli.status", "live instances, pool and EPLB at a glance", {}),
    (("config", "check"), "pdmesh.shared.cli.config_check",
     "print the effective --additional-config or its errors", {}),
]


def _runner(module: str, kwargs: dict[str, Any]) -> Callable[[argparse.Namespace], int]:
    return lambda a: importlib.import_module(module).run(a, **kwargs)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or with ``only`` a command's arguments alone filled in."""
    p = argparse.ArgumentParser(prog="pdmesh", description=__doc__)
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--log-format", default="text", choices=("text", "json"))
    # the same two after the command (pdmesh gateway --log-level info), where users of
    # vllm serve / sglang put them; SUPPRESS keeps the ones given before it otherwise
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS)
    common.add_argument("--log-format", default=argparse.SUPPRESS, choices=("text", "json"))
    sub = p.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for words, module, help_, kwargs in COMMANDS:
        parent = sub
        if len(words) == 2:
            if words[0] not in groups:
                g = sub.add_parser(words[0], help=f"{words[0]} commands")
                groups[words[0]] = g.add_subparsers(dest=words[0], required=True)
            parent = groups[words[0]]
        cmd = parent.add_parser(words[-1], help=help_, parents=[common])
        if only is None or only == words[0]:
            importlib.import_module(module).add_args(cmd)
            _model_positional(cmd)
        cmd.set_defaults(func=_runner(module, kwargs))
    return p


def _model_positional(cmd: argparse.ArgumentParser) -> None:
    """A command with ``--model`` also takes the model positionally, as ``vllm serve
    MODEL`` does; a required ``--model`` becomes "one of the two", checked after parsing."""
    flag = next((a for a in cmd._actions if "--model" in a.option_strings), None)
    if flag is None:
        return
    if flag.required:
        flag.required = False
        cmd.set_defaults(model_required=True)
    cmd.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="the model, as `vllm serve MODEL` takes it (or --model)")


def _resolve_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            parser.error(f"model: given twice, as {tag!r} and --model {args.model!r}")
        args.model = tag
    if getattr(args, "model_required", False) and not args.model:
        parser.error("model: required (pdmesh COMMAND MODEL ... or --model MODEL)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = {words[0] for words, *_ in COMMANDS}
    only = next((x for x in argv if x in names), None)
    parser = build_parser(only)
    args = parser.parse_args(argv)
    _resolve_model(args, parser)
    from pdmesh.shared.infra.logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        print(f"pdmesh: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
