"""Count SGLang's flags (those the seeds mark supported on Ascend) by what pdmesh does
with each: takes effect, or without effect for which kind of reason.

    .venv/bin/python scripts/sglang_flags.py [--flags TSV] [--list]

Each flag is read alone on an SGLang line (`pdmesh sglang --model-path M FLAG VALUE`),
translated and checked as `pdmesh config check` checks it (on cpu); it takes effect
unless the check lists it, or says it, to be without effect (a flag that acts only
beside its switch, given alone, is said to be). ``--list`` prints every
flag without effect with its reason (shared/config/sglang_flags.py).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

from pdmesh.cli import _translated_line
from pdmesh.shared.config.serve import serve_config
from pdmesh.shared.config.sglang_flags import WITHOUT_EFFECT

TSV = Path(__file__).parents[1] / "tests" / "shared" / "config" / "data" / \
    "sglang_ascend_flags.tsv"


def verdict(flag: str, value: str) -> tuple[str, str]:
    """(what pdmesh does with it, why) for one flag on a line of its own."""
    line = _translated_line(["sglang", "--model-path", "/tmp/m", "--device", "cpu", flag,
                             *([value] if value else [])])
    role = {"serve": "mixed"}.get(line[0], line[0])
    try:
        cfg = serve_config("config check", ["--role", role, *line[1:]], device="cpu")
    except ValueError as e:
        return "refused alone", str(e)
    kinds = {name: (kind, why) for name, _, aliases, kind, why in WITHOUT_EFFECT
             for name in (name, *aliases)}
    if flag in cfg.accepted_without_effect:
        kind, why = kinds.get(flag, ("a vLLM flag pdmesh lists", ""))
        return f"without effect: {kind}", why
    said = next((w for w in cfg.flag_warnings if w.startswith(f"{flag}: without effect")),
                None)
    if said is not None:  # (a companion given alone: it acts with its switch)
        return "without effect: read with its switch", said
    return "takes effect", ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flags", type=Path, default=TSV)
    p.add_argument("--list", action="store_true")
    a = p.parse_args()
    rows = [ln.split("\t") for ln in a.flags.read_text().splitlines()
            if ln and not ln.startswith("#")]
    verdicts = {flag: verdict(flag, value) for flag, value in rows}
    counts = collections.Counter(v for v, _ in verdicts.values())
    print(f"{len(rows)} SGLang flags the seeds mark supported on Ascend:")
    for what, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:3d}  {what}")
    if a.list:
        for flag, (what, why) in verdicts.items():
            if what != "takes effect":
                print(f"{flag}\t{what}\t{why}")


if __name__ == "__main__":
    main()
