"""The user guide, checked as a reader uses it: README.md, deploy/README.md and docs/ (the
site mkdocs builds from mkdocs.yml).

- the generated reference pages (docs/reference/) are what shared/config/reference.py
  makes from today's flag table and schema (`make reference` rewrites them);
- `mkdocs build --strict` passes: every page in the nav, every link and anchor resolves;
- every relative link in the README files and docs/ resolves, anchors included;
- every shell command in their code blocks names something that exists: a make target, a
  pdmesh command (whose --help lists each flag the line gives), a script, a module, a
  path of the repository;
- scripts/ensure_compose.sh puts Compose v2 where Docker looks for its plugins.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from pdmesh.cli import COMMANDS
from pdmesh.shared.config.reference import PAGES, REFRESH

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = [ROOT / "README.md", ROOT / "deploy" / "README.md",
            *sorted((ROOT / "docs").rglob("*.md"))]
# fenced blocks read as shell commands (and indented blocks, as docs/benchmarks.md
# records the commands it ran; a bare fence holds a drawing or a listing)
SHELL = {"sh", "bash", "shell", "console", "indented"}
REPO_DIRS = ("deploy", "scripts", "docs", "tests", "shared", "services", "pdmesh",
             "requirements")
PYTHONS = {"python", "python3", ".venv/bin/python", ".venv/bin/python3"}
PDMESH = {"pdmesh", ".venv/bin/pdmesh"}
PREFIXES = {"sudo", "env", "time", "exec", "nohup"}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- the generated reference ----------------------------------------------------------------

@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_reference_pages_are_current(page):
    made = PAGES[page]()
    path = ROOT / page
    kept = path.read_text() if path.exists() else ""
    diff = list(difflib.unified_diff(kept.splitlines(), made.splitlines(), "checked in",
                                     "made now", n=0, lineterm=""))[:12]
    assert kept == made, (f"{page} is stale: run `{REFRESH}` (.venv/bin/python -m "
                          "pdmesh.shared.config.reference)\n" + "\n".join(diff))


# -- the site -------------------------------------------------------------------------------

def test_the_guide_builds_strictly(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                          "--config-file", str(ROOT / "mkdocs.yml"),
                          "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "reference" / "flags" / "index.html").exists()


def test_the_site_folder_is_ignored_by_git():
    assert "site/" in (ROOT / ".gitignore").read_text().split()


# -- reading markdown -----------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based, of the block's first line
    lang: str
    lines: tuple[str, ...]


def spans(lines: list[str]) -> Iterator[tuple[int, int, str, list[str]]]:
    """Each code block of a markdown file's lines: the lines it spans [start, end), its
    language ("indented" for an indented block, "" for a bare fence) and its content."""
    i = 0
    while i < len(lines):
        fence = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", lines[i])
        if fence:
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith(fence.group(1)):
                end += 1
            yield i, end + 1, fence.group(2), lines[i + 1:end]
            i = end + 1
        elif lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            yield i, end, "indented", [line[4:] for line in lines[i:end]]
            i = end
        else:
            i += 1


def blocks(path: Path) -> Iterator[Block]:
    """The code blocks of a markdown file: fenced (with their language) and indented."""
    lines = path.read_text().splitlines()
    for start, _, lang, content in spans(lines):
        first = start + 2 if lines[start].lstrip().startswith(("```", "~~~")) else start + 1
        yield Block(path, first, lang, tuple(content))


def prose(path: Path) -> str:
    """The file without its code blocks and code spans."""
    lines = path.read_text().splitlines()
    for start, end, _, _ in spans(lines):
        lines[start:end] = [""] * (end - start)
    return re.sub(r"`[^`\n]*`", "", "\n".join(lines))


# -- links ----------------------------------------------------------------------------------

def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


@cache
def anchors(path: Path) -> frozenset[str]:
    return frozenset(slug(m.group(1)) for m in
                     re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose(path), re.M))


def links(path: Path) -> Iterator[str]:
    for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose(path)):
        yield m.group(1)


def test_every_relative_link_resolves():
    broken = []
    for path in MARKDOWN:
        for target in links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...
                continue
            file, _, anchor = target.partition("#")
            where = (path.parent / file).resolve() if file else path
            if not where.exists():
                broken.append(f"{rel(path)}: {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                broken.append(f"{rel(path)}: {target} (no heading with that anchor)")
    assert broken == []
    assert list(links(ROOT / "README.md")), "the README links no page of the guide"


# -- shell commands -------------------------------------------------------------------------

def command_lines(block: Block) -> Iterator[tuple[int, str]]:
    """A block's logical lines: continuations joined, a console's `$ ` dropped."""
    held, start = "", 0
    for n, line in enumerate(block.lines):
        line = re.sub(r"^\$ ", "", line)
        if not held:
            start = block.line + n
        if line.rstrip().endswith("\\"):
            held += line.rstrip()[:-1] + " "
            continue
        yield start, held + line
        held = ""
    if held:
        yield start, held


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line (split at ;, &&, ||, |, redirections)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out: list[list[str]] = [[]]
    for token in lexer:
        if token and set(token) <= set("();<>|&"):
            out.append([])
        else:
            out[-1].append(token)
    return [c for c in out if c]


@dataclass
class Findings:
    problems: list[str]
    pdmesh: dict[str, list[tuple[str, list[str]]]]  # command -> (where, its words)


@cache
def make_targets() -> frozenset[str]:
    names = set()
    for m in re.finditer(r"^([A-Za-z0-9][\w. -]*?)\s*:(?!=)", (ROOT / "Makefile").read_text(),
                         re.M):
        names.update(m.group(1).split())
    return frozenset(names)


def pdmesh_command(words: list[str]) -> tuple[str | None, list[str]]:
    """The pdmesh command a line runs, and the words after it."""
    i = 0
    while i < len(words) and words[i].startswith("-"):
        i += 2 if words[i] in ("--log-level", "--log-format") else 1
    for n in (2, 1):
        name = " ".join(words[i:i + n])
        if any(c.name == name for c in COMMANDS):
            return name, words[i + n:]
    return None, words[i:]


def check_command(words: list[str], where: str, found: Findings) -> None:
    while words and (re.match(r"^\w+=", words[0]) or words[0] in PREFIXES):
        words = words[1:]
    if not words:
        return
    for word in words:  # scripts/..., deploy/k8s/...: paths of the repository
        path = word.removeprefix("./")
        if path.split("/")[0] in REPO_DIRS and "/" in path and not re.search(r"[*{}$]", path):
            if not (ROOT / path).exists():
                found.problems.append(f"{where}: {word}: no such path")
    head, args = words[0], words[1:]
    if head == "make":
        for target in (a for a in args if not a.startswith("-") and "=" not in a):
            if target not in make_targets():
                found.problems.append(f"{where}: make {target}: no such target")
    elif head in PDMESH or (head in PYTHONS and args[:2] == ["-m", "pdmesh"]):
        rest = args if head in PDMESH else args[2:]
        name, after = pdmesh_command(rest)
        if name is None:
            found.problems.append(f"{where}: pdmesh {' '.join(rest[:2])}: not a command")
        else:
            found.pdmesh.setdefault(name, []).append((where, after))
    elif head in PYTHONS and args[:1] == ["-m"] and len(args) > 1:
        if importlib.util.find_spec(args[1]) is None:
            found.problems.append(f"{where}: python -m {args[1]}: no such module")


def doc_commands() -> Findings:
    found = Findings([], {})
    for path in MARKDOWN:
        for block in blocks(path):
            if block.lang not in SHELL:
                continue
            for line_no, line in command_lines(block):
                where = f"{rel(path)}:{line_no}"
                try:
                    commands = simple_commands(line)
                except ValueError as e:  # unbalanced quotes
                    if block.lang != "indented":  # (there: maybe not a command at all)
                        found.problems.append(f"{where}: cannot be read as shell: {e}")
                    continue
                for words in commands:
                    check_command(words, where, found)
    return found


# `python -m pdmesh COMMAND --help` for many commands in one process (torch, which some
# commands' modules import, loads once): {command: [exit status, what it printed]}
HELP_DRIVER = """
import contextlib, io, json, sys
from pdmesh.cli import main
out = {}
for name in sys.argv[1:]:
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            code = main([*name.split(), "--help"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out[name] = [code, buf.getvalue()]
print(json.dumps(out))
"""


def help_texts(commands: list[str]) -> dict[str, tuple[int, str]]:
    run = subprocess.run([sys.executable, "-c", HELP_DRIVER, *commands], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return {name: (code, text) for name, (code, text) in json.loads(run.stdout).items()}


def unknown_flags(words: list[str], help_: str) -> list[str]:
    """The flags a command line gives that the command's --help does not list."""
    missing = []
    for word in words:
        m = re.match(r"^(--?[A-Za-z][\w-]*)(=.*)?$", word)
        if not m:
            continue
        names = {m.group(1), m.group(1).replace("_", "-")}
        if not any(re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", help_) for n in names):
            missing.append(m.group(1))
    return missing


def test_every_command_in_the_docs_names_something_that_exists():
    found = doc_commands()
    assert found.pdmesh, "no pdmesh command found in the docs' code blocks"
    for command, (code, text) in help_texts(sorted(found.pdmesh)).items():
        if code != 0:
            found.problems.append(f"pdmesh {command} --help: exit {code}: {text[-300:]}")
            continue
        for where, words in found.pdmesh[command]:
            found.problems += [f"{where}: pdmesh {command}: {flag}: not one of its flags"
                               for flag in unknown_flags(words, text)]
    assert found.problems == []


def test_the_command_reader_catches_what_does_not_exist(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```sh\nmake no-such-target && pdmesh no-such-command\n"
                    "bash scripts/no_such.sh; .venv/bin/python -m pdmesh up --no-such-flag\n"
                    "kubectl apply -f deploy/no-such-folder # a comment, make bogus\n```\n")
    found = Findings([], {})
    for block in blocks(page):
        for n, line in command_lines(block):
            for words in simple_commands(line):
                check_command(words, f"page.md:{n}", found)
    assert [p.split(": ", 1)[1] for p in found.problems] == [
        "make no-such-target: no such target", "pdmesh no-such-command: not a command",
        "scripts/no_such.sh: no such path", "deploy/no-such-folder: no such path"]
    assert found.pdmesh == {"up": [("page.md:3", ["--no-such-flag"])]}
    assert unknown_flags(["--no-such-flag", "--max_model_len", "-tp", "-1"],
                         help_texts(["serve"])["serve"][1]) == ["--no-such-flag"]


# -- docker compose, as the docs run it -----------------------------------------------------

def test_ensure_compose_installs_compose_where_docker_finds_it(tmp_path):
    """`make image` runs scripts/ensure_docker.sh, which runs this: afterwards `docker
    compose` answers in any shell (here: a DOCKER_CONFIG of the test's own)."""
    assert "scripts/ensure_compose.sh" in (ROOT / "scripts" / "ensure_docker.sh").read_text()
    env = {**os.environ, "COMPOSE_PLUGIN_DIR": str(tmp_path / "cli-plugins"),
           "DOCKER_CONFIG": str(tmp_path), "PY": sys.executable}
    run = subprocess.run(["bash", "scripts/ensure_compose.sh"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    plugin = tmp_path / "cli-plugins" / "docker-compose"
    assert plugin.is_file() and os.access(plugin, os.X_OK)
    assert re.search(r"Docker Compose version v2\.", run.stdout), run.stdout
    if shutil.which("docker"):  # (a fresh machine has no docker before `make image`)
        version = subprocess.run(["docker", "compose", "version"], env=env,
                                 capture_output=True, text=True, timeout=60)
        assert version.returncode == 0, version.stderr
