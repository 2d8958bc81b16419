"""The device ops the npu and cuda backends call, checked against their vendors' own
declarations without the device (issue 42).

No NPU or GPU has run these backends: a wrong keyword or a missing argument would fail
the first real user's first request. torch-npu's wheel ships the schemas of its ops
(``npu_native_functions_by_codegen.yaml``, in ATen's schema language) and the C++
declarations of its private ATB ops (``AtbOpsInterface.h``); torch itself knows its own
ops' schemas and its Python functions' signatures. Every call of such an op in a source
file is read with ``ast`` and checked: the op exists; its positional arguments fit its
positional parameters; each keyword names a parameter (not one already given by
position); every parameter without a default is given; a call whose result is unpacked
into a tuple unpacks as many values as the op returns. An op with overloads is called
right if one of them takes the call (the Python binding picks among them).

Types and values are not checked here (layouts, dtypes: the stand-ins' work).
"""

from __future__ import annotations

import ast
import inspect
import re
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

# where torch-npu's wheel keeps what is read here
SCHEMA_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
ATB_HEADER = "torch_npu/include/third_party/op-plugin/op_plugin/include/AtbOpsInterface.h"


@dataclass(frozen=True)
class Param:
    name: str
    required: bool  # no default
    keyword_only: bool = False


@dataclass(frozen=True)
class Schema:
    """One overload of an op: its parameters in order, and how many values it returns
    (None: a list, or not known - any unpacking is taken)."""

    name: str
    params: tuple[Param, ...]
    returns: int | None
    # the first parameter a list of ints, which torch's Python binding also takes as
    # several ints (``torch.zeros(2, 3)``)
    int_list_first: bool = False

    def refuses(self, positional: int, keywords: Iterable[str], star: bool = False,
                unpacked: int | None = None) -> str | None:
        """Why a call with ``positional`` arguments and these ``keywords`` (``star``: a
        ``*args`` / ``**kwargs`` among them, so counts are not known) does not fit; None
        when it does."""
        by_position = [p for p in self.params if not p.keyword_only]
        if self.int_list_first and positional > 1 and len(by_position) == 1:
            positional = 1  # (the ints of the list)
        if not star and positional > len(by_position):
            return f"{positional} positional arguments, it takes {len(by_position)}"
        names = {p.name for p in self.params}
        given = {p.name for p in by_position[:positional]}
        for k in keywords:
            if k not in names:
                return f"no parameter {k!r} (it has {', '.join(sorted(names))})"
            if k in given:
                return f"{k!r} given by position and by keyword"
            given.add(k)
        missing = [p.name for p in self.params if p.required and p.name not in given]
        if missing and not star:
            return f"required {', '.join(missing)} not given"
        if unpacked is not None and self.returns is not None and unpacked != self.returns:
            return f"unpacked into {unpacked} values, it returns {self.returns}"
        return None


# -- reading the declarations ---------------------------------------------------------
def _split_top(text: str) -> list[str]:
    """``text`` split at its top-level commas (not those inside brackets or quotes)."""
    out, depth, cur, quote = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def parse_aten(decl: str) -> Schema:
    """One ATen schema, ``name[.overload](args) -> returns``."""
    m = re.fullmatch(r"\s*([\w.]+)\((.*)\)\s*->\s*(.+?)\s*", decl, re.S)
    if m is None:
        raise ValueError(f"not an ATen schema: {decl[:80]!r}")
    name, args, ret = m.group(1).split(".")[0], m.group(2), m.group(3)
    params, kw_only, int_list = [], False, False
    for i, arg in enumerate(_split_top(args)):
        if arg == "*":
            kw_only = True
            continue
        head, _, default = arg.partition("=")
        int_list |= i == 0 and re.match(r"(Sym)?[Ii]nt\[\d*\]\s", head) is not None
        params.append(Param(head.split()[-1], not default, kw_only))
    return Schema(name, tuple(params), _aten_returns(ret), int_list)


def _aten_returns(ret: str) -> int | None:
    ret = ret.strip()
    if ret == "()":
        return 0
    if ret.startswith("("):
        return len(_split_top(ret[1:-1]))
    return None if ret.endswith("[]") else 1


def parse_atb(header: str) -> list[Schema]:
    """The ATB ops' C++ declarations (no defaults: every parameter is required; a
    ``void`` op writes into its ``out`` tensors and returns nothing)."""
    out = []
    for m in re.finditer(r"TORCH_NPU_API\s+(.+?)\s+(\w+)\((.*?)\);", header, re.S):
        ret, name, args = m.groups()
        params = tuple(Param(re.split(r"[\s&*]+", a.strip())[-1], True)
                       for a in _split_top(args))
        tup = re.fullmatch(r"std::tuple<(.*)>", ret.strip())
        returns = 0 if ret.strip() == "void" else len(_split_top(tup.group(1))) if tup else 1
        out.append(Schema(name, params, returns))
    return out


def npu_schemas(wheel: Path) -> dict[str, list[Schema]]:
    """op name -> its overloads, from torch-npu's wheel (public ops and ATB ops)."""
    with zipfile.ZipFile(wheel) as z:
        yaml_text = z.read(SCHEMA_YAML).decode()
        header = z.read(ATB_HEADER).decode()
    found: dict[str, list[Schema]] = {}
    # (the file's other sections list some ops by bare name: only schemas are read)
    for m in re.finditer(r"^\s*-?\s*func:\s*(\S+\(.*\)\s*->.+)$", yaml_text, re.M):
        s = parse_aten(m.group(1))
        found.setdefault(s.name, []).append(s)
    for s in parse_atb(header):
        found.setdefault(s.name, []).append(s)
    return found


def torch_schemas(fn: Callable) -> list[Schema]:
    """A torch callable's overloads: an ATen builtin's schemas, else its Python
    signature."""
    import torch

    name = getattr(fn, "__name__", "")
    aten = torch._C._jit_get_schemas_for_operator(f"aten::{name}") if name else []
    if aten and not inspect.isfunction(fn):
        return [parse_aten(str(s).split("::", 1)[1]) for s in aten]
    sig = inspect.signature(fn)
    params = tuple(Param(p.name, p.default is inspect.Parameter.empty,
                         p.kind is inspect.Parameter.KEYWORD_ONLY)
                   for p in sig.parameters.values()
                   if p.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                     inspect.Parameter.VAR_KEYWORD))
    return [Schema(name, params, None)]


# -- reading the calls -----------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    """One call of ``<module>.<op>(...)`` in a source file."""

    op: str
    where: str  # file:line
    positional: int
    keywords: tuple[str, ...]
    star: bool  # *args or **kwargs in it
    unpacked: int | None  # the tuple it is assigned to (None: not unpacked)


def calls_in(source: str, filename: str, owners: dict[str, str],
             callees: dict[str, str] | None = None) -> list[Call]:
    """The calls in ``source`` of an attribute of one of ``owners`` (the dotted name as
    written -> a label: ``{"torch_npu": "npu", "F": "torch.nn.functional"}``), and of the
    ``callees`` named whole (``{"self._flash": "torch.nn.attention.varlen.varlen_attn"}``:
    a function kept under another name)."""
    callees = callees or {}
    tree = ast.parse(source, filename)
    unpacking: dict[int, int] = {}  # id(call) -> how many names it is unpacked into
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            target = node.targets[0]
            if isinstance(target, ast.Tuple | ast.List):
                unpacking[id(node.value)] = len(target.elts)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        callee = ast.unparse(node.func)
        if callee in callees:
            op = callees[callee]
        elif isinstance(node.func, ast.Attribute) and \
                ast.unparse(node.func.value) in owners:
            op = f"{owners[ast.unparse(node.func.value)]}.{node.func.attr}"
        else:
            continue
        star = any(isinstance(a, ast.Starred) for a in node.args) or any(
            k.arg is None for k in node.keywords)
        out.append(Call(op, f"{filename}:{node.lineno}",
                        sum(not isinstance(a, ast.Starred) for a in node.args),
                        tuple(k.arg for k in node.keywords if k.arg is not None), star,
                        unpacking.get(id(node))))
    return out


def check(calls: Iterable[Call], schemas: Callable[[str], list[Schema]]) -> list[str]:
    """Each call that no overload of its op takes, with why (``schemas``: an op's
    overloads by its label, [] when it does not exist)."""
    problems = []
    for c in calls:
        overloads = schemas(c.op)
        if not overloads:
            problems.append(f"{c.where}: {c.op}: no such op")
            continue
        why = [s.refuses(c.positional, c.keywords, c.star, c.unpacked) for s in overloads]
        if all(why):
            problems.append(f"{c.where}: {c.op}: {'; '.join(dict.fromkeys(why))}")
    return problems
