"""Keys set under a section whose ``enabled`` switch is off: each section's fields act
only when it is on (DyntraLB's, ShortRequestFirst's, the profiling chunk's, ...), so
setting them with the switch off is said, not silently ignored."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from pdmesh.shared.config.rules.base import Findings, RuleContext


def _switched_off(obj: object, path: str) -> Iterator[str]:
    """The dotted paths of every section below ``obj`` whose ``enabled`` is false."""
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if not dataclasses.is_dataclass(value):
            continue
        here = f"{path}.{f.name}" if path else f.name
        if getattr(value, "enabled", True) is False:
            yield here
        yield from _switched_off(value, here)


def keys_of_a_switched_off_section(ctx: RuleContext, out: Findings) -> None:
    for section in _switched_off(ctx.config, ""):
        idle = [p for p in ctx.set_under(section) if p != f"{section}.enabled"]
        if idle:
            out.warn(", ".join(ctx.name(p) for p in idle),
                     f"without effect while {ctx.name(section + '.enabled')} is false")


RULES = (keys_of_a_switched_off_section,)
