"""How a schema field is declared: ``option()`` for a value, ``section()`` for an object.

Every section of ``--additional-config`` is a frozen dataclass. Each field carries an
``OptionSpec`` in its metadata: one line of documentation, the allowed choices or range,
and whether the option only acts on Ascend NPUs. ``pdmesh.shared.config.reader`` walks these
dataclasses to check raw JSON, so a key, its type and its default are written once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

_SPEC = "pdmesh.additional_config"


@dataclass(frozen=True)
class OptionSpec:
    """What the schema knows about one key besides its Python type and default."""

    doc: str
    ascend_only: bool = False  # acts only on Ascend NPUs (inactive on cpu / cuda)
    choices: tuple[object, ...] | None = None
    ge: float | None = None  # value >= ge
    gt: float | None = None  # value > gt
    le: float | None = None  # value <= le
    multiple_of: int | None = None
    suffix: str | None = None  # a path that must end this way, e.g. ".json"
    # vLLM-Ascend reads the value through int() / float() / bool(): "256" and 256.7 are
    # 256 there, 1 is true (accepted here too, with a warning naming what was read)
    cast: bool = False
    # vLLM-Ascend tests the raw value for truthiness: the string "false" is true there
    truthy: bool = False

    def violation(self, value: object) -> str | None:
        """What ``value`` should have been, or None when it is allowed. ``None`` always is."""
        if value is None:
            return None
        if self.choices is not None:
            if value not in self.choices:
                return "one of " + ", ".join(_show(c) for c in self.choices)
            return None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return self._numeric_violation(value)
        if self.suffix is not None and isinstance(value, str) and not value.endswith(self.suffix):
            return f"a path ending in {self.suffix!r}"
        return None

    def _numeric_violation(self, value: float) -> str | None:
        bounds = []
        if self.gt is not None:
            bounds.append(f"> {_show(self.gt)}")
        if self.ge is not None:
            bounds.append(f">= {_show(self.ge)}")
        if self.le is not None:
            bounds.append(f"<= {_show(self.le)}")
        ok = (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.le is None or value <= self.le)
        )
        if self.multiple_of is not None:
            bounds.append(f"a multiple of {self.multiple_of}")
            ok = ok and value % self.multiple_of == 0
        return None if ok else " and ".join(bounds)


def option(default: Any, doc: str, **constraints: Any) -> Any:
    """A scalar or list key: its vLLM-Ascend default, doc line and constraints."""
    return dataclasses.field(default=default, metadata={_SPEC: OptionSpec(doc, **constraints)})


def section(factory: type, doc: str, *, ascend_only: bool = False) -> Any:
    """A nested object key whose own keys are the fields of ``factory``."""
    spec = OptionSpec(doc, ascend_only=ascend_only)
    return dataclasses.field(default_factory=factory, metadata={_SPEC: spec})


def spec_of(field: dataclasses.Field[Any]) -> OptionSpec | None:
    """The field's spec, or None for a field that is not a configuration key."""
    return field.metadata.get(_SPEC)


def schema_fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    """The fields of a schema dataclass that are configuration keys, in declaration order."""
    return tuple(f for f in dataclasses.fields(cls) if spec_of(f) is not None)


def _show(value: object) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
