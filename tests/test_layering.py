"""The packages' layering, read from the source with ``ast``:

    pdmesh (the command) ──▶ services ──▶ shared        shared never imports services;
    a service never imports another service's modules; no import cycles anywhere;
    shared's packages in layers that only import downward (SHARED_LAYERS);
    the gateway's functions each fit on a screen, and the engine's and the services'
    too, but for the exceptions docs/architecture.md names with their reasons.

The folders are read as setup.py installs them (FOLDERS: ``shared/engine/llm.py`` is
``pdmesh.shared.engine.llm``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"pdmesh": "pdmesh", "shared": "pdmesh.shared", "services": "pdmesh.services"}
MAX_GATEWAY_FUNCTION_LINES = 60
# shared/'s packages, lowest first: each imports only itself and those before it
SHARED_LAYERS = ["kernels", "infra", "proto", "parallel", "models", "kvpool", "engine",
                 "training", "config", "runtime", "cli"]
MAX_FUNCTION_LINES = 60  # in shared/engine/ and services/, but for the named exceptions
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def modules() -> dict[str, Path]:
    """Every project module by its import name."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports(path: Path, name: str) -> Iterator[str]:
    """The project modules (or packages) ``path`` imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        edges[name] = {m for m in imports(path, name) if m in mods and m != name}
    return edges


def test_every_module_is_found_and_the_old_top_level_names_are_gone():
    mods = modules()
    assert "pdmesh.shared.runtime.protocol" in mods and "pdmesh.services.gateway.app" in mods
    for name, path in mods.items():
        for imported in imports(path, name):
            top = imported.split(".")[0]
            assert top not in ("shared", "services"), f"{name} imports {imported}"


def test_shared_never_imports_services():
    offenders = [(m, i) for m, deps in graph().items() if m.startswith("pdmesh.shared")
                 for i in deps if i.startswith("pdmesh.services")]
    assert offenders == []
    # nor names a service module in a string, to import it later (docstrings aside)
    for name, path in modules().items():
        if name.startswith("pdmesh.shared"):
            named = [s for s in code_strings(path) if s.startswith("pdmesh.services")]
            assert named == [], name


def code_strings(path: Path) -> list[str]:
    """The string constants of a module's code, its docstrings left out."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docs]


def test_no_service_imports_another_services_modules():
    offenders = []
    for m, deps in graph().items():
        if not m.startswith("pdmesh.services."):
            continue
        own = m.split(".")[2]
        offenders += [(m, i) for i in deps if i.startswith("pdmesh.services.")
                      and i.split(".")[2] != own]
    assert offenders == []


def test_no_import_cycles():
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    # a package importing its own sub-module (an __init__ re-export) is not a cycle
    real = [c for c in cycles if not all(_within_one_package(c))]
    assert real == []


def _within_one_package(component: list[str]) -> Iterator[bool]:
    shortest = min(component, key=len)
    for m in component:
        yield m == shortest or m.startswith(shortest + ".")


def test_the_gateways_functions_fit_on_a_screen():
    longest = []
    for path in sorted((ROOT / "services" / "gateway").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                longest.append((length, f"{path.name}:{node.name}"))
    assert max(longest)[0] < MAX_GATEWAY_FUNCTION_LINES, max(longest)


def test_shared_layers_only_import_downward():
    """An import at any depth (a function's too), or a module named in a string to
    import later, counts; a new package of shared/ needs its place in SHARED_LAYERS."""
    rank = {layer: i for i, layer in enumerate(SHARED_LAYERS)}
    mods = modules()
    assert {m.split(".")[2] for m in mods if m.startswith("pdmesh.shared.")} == set(rank)

    def above(module: str, named: str) -> bool:
        return named.startswith("pdmesh.shared.") and named.split(".")[2] in rank \
            and rank[named.split(".")[2]] > rank[module.split(".")[2]]

    upward = [f"{m} -> {i}" for m, deps in graph().items() if m.startswith("pdmesh.shared.")
              for i in sorted(deps) if above(m, i)]
    upward += [f"{m} names {s}" for m, path in mods.items() if m.startswith("pdmesh.shared.")
               for s in code_strings(path) if above(m, s)]
    assert upward == []


def function_lengths(folder: Path) -> Iterator[tuple[str, int]]:
    """(name, lines) of every function under ``folder``, named by its module's path from
    there and its qualified name: ``dyntralb.balance_load``, ``gateway.app.Gateway.serve``."""
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield from _functions(ast.parse(path.read_text()), ".".join(parts))


def _functions(node: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}.{child.name}" if prefix else child.name
            if not isinstance(child, ast.ClassDef):
                yield name, child.end_lineno - child.lineno + 1
            yield from _functions(child, name)
        else:
            yield from _functions(child, prefix)


def long_function_exceptions() -> dict[str, str]:
    """docs/architecture.md's "Long functions" section: one ``- `name`: reason`` line per
    function allowed over MAX_FUNCTION_LINES."""
    text = ARCHITECTURE.read_text()
    assert "\n## Long functions\n" in text, "docs/architecture.md: no Long functions section"
    section = text.split("\n## Long functions\n", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^- `([\w.]+)`: *(\S.*)$", section, re.MULTILINE))


def test_the_engines_and_services_functions_fit_on_a_screen():
    allowed = long_function_exceptions()
    long = {name: n for folder in (ROOT / "shared" / "engine", ROOT / "services")
            for name, n in function_lengths(folder) if n > MAX_FUNCTION_LINES}
    assert {name: n for name, n in long.items() if name not in allowed} == {}
    # an exception that is gone, or fits now, comes off the list
    assert sorted(set(allowed) - set(long)) == []
