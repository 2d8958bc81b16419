"""One home for each engine default: EngineConfig's fields. The flag table reads them
(``ENGINE_DEFAULT``), the offline ``LLM`` takes them as they are."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

from pdmesh.shared.config import flags
from pdmesh.shared.config.flags import FLAGS
from pdmesh.shared.engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[3]
FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
# flags named like an EngineConfig field whose default means something else there
NOT_THE_FIELDS = {
    "--model": "required: the engine has no default model",
    "--data-parallel-rank": "None: the launcher starts every rank; the engine is one rank (0)",
    "--data-parallel-address": "a host (default: --host); the engine's is rank 0's host:port",
}


def engine_field(flag: flags.Flag) -> str | None:
    """The EngineConfig field a flag fills (``--kv-load-timeout``: ``kv_load_timeout_s``)."""
    for name in (flag.attr, f"{flag.attr}_s"):
        if name in FIELDS and flag.name not in NOT_THE_FIELDS:
            return name
    return None


def test_the_engine_flags_default_as_engine_config_does():
    mapped = {f.name: engine_field(f) for f in FLAGS if engine_field(f)}
    assert {"--seed", "--block-size", "--max-num-seqs", "--gpu-memory-utilization",
            "--enable-prefix-caching", "--kv-load-timeout"} <= set(mapped)
    differ = {f.name: (f.default, FIELDS[mapped[f.name]].default) for f in FLAGS
              if f.name in mapped and f.default != FIELDS[mapped[f.name]].default}
    assert differ == {}


def test_the_flag_table_spells_no_engine_default_itself():
    """Each engine flag's default in flags.py is ``ENGINE_DEFAULT[field]``, not a literal
    that would have to be kept equal by hand."""
    mapped = {f.name: engine_field(f) for f in FLAGS if engine_field(f)}
    path = ROOT / "shared" / "config" / "flags.py"
    spelled = {}
    for node in ast.walk(ast.parse(path.read_text())):
        # ("--name", kind, default, help, ...) in _flags, Flag("--name", kind, commands, default)
        if isinstance(node, ast.Tuple):
            items, at = node.elts, 2
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Flag":
            items, at = node.args, 3
        else:
            continue
        if items and isinstance(items[0], ast.Constant) and items[0].value in mapped \
                and len(items) > at:
            spelled[items[0].value] = ast.unparse(items[at])
    assert spelled == {name: f"ENGINE_DEFAULT[{field!r}]" for name, field in mapped.items()}


def test_llm_defines_no_engine_default():
    """``LLM(model, tokenizer=None, **engine_args)``: every engine keyword goes to
    EngineConfig as given, so its defaults are EngineConfig's."""
    path = ROOT / "shared" / "engine" / "llm.py"
    tree = ast.parse(path.read_text())
    init = next(n for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "LLM"
                for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args
    assert [a.arg for a in args.args] == ["self", "model"]
    # (the LLM's own: the tokenizer, and where generate's default sampling comes from)
    own = ["tokenizer", "generation_config", "override_generation_config"]
    assert [a.arg for a in args.kwonlyargs] == own
    assert not set(own[1:]) & set(FIELDS)
    assert args.kwarg is not None and args.kwarg.arg == "engine_args"


def test_reading_the_defaults_imports_no_torch():
    """The flag table is read by every `pdmesh` command, the light ones too: EngineConfig's
    module must stay free of torch at import."""
    code = ("import sys\nimport pdmesh.shared.config.flags\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
