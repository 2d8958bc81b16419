"""What a cross-key rule sees and what it may say.

A rule is a small function ``(RuleContext, Findings) -> None``. It reads the typed config
and the engine flags, and reports an error (start-up must stop), a warning, or an
override (a value the engine will really use, e.g. recompute switched off on a prefill
node). Overrides are applied after every rule has run, so rules do not depend on order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pdmesh.shared.config.engine_args import EngineArgs
from pdmesh.shared.config.errors import ConfigProblem
from pdmesh.shared.config.schema import AdditionalConfig


@dataclass(frozen=True)
class RuleContext:
    """The parsed config before overrides, the engine flags, and which keys were set."""

    config: AdditionalConfig
    engine: EngineArgs  # model_runner_v2 already resolved to a bool
    explicit: frozenset[str]  # canonical dotted paths the user (or an env var) set
    shown: Mapping[str, str]  # canonical path -> the spelling the user wrote

    def is_set(self, path: str) -> bool:
        return path in self.explicit

    def name(self, path: str) -> str:
        """``path`` as the user spelled it, for messages."""
        if path in self.shown:
            return self.shown[path]
        parent, _, leaf = path.rpartition(".")
        return f"{self.name(parent)}.{leaf}" if parent else path

    def set_under(self, section: str) -> list[str]:
        """The keys set below ``section`` (not the section itself), sorted."""
        prefix = section + "."
        return sorted(p for p in self.explicit if p.startswith(prefix))


@dataclass
class Findings:
    """Everything the rules said, in the order they said it."""

    problems: list[ConfigProblem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    overrides: dict[str, object] = field(default_factory=dict)

    def error(self, key: str, message: str) -> None:
        self.problems.append(ConfigProblem(key, message))

    def warn(self, key: str, message: str) -> None:
        self.warnings.append(f"{key}: {message}")

    def override(self, path: str, value: object, warning: str | None = None,
                 key: str | None = None) -> None:
        """Make the effective value of ``path`` be ``value``; warn when ``warning`` is given."""
        self.overrides[path] = value
        if warning is not None:
            self.warn(key or path, warning)


Rule = Callable[[RuleContext, Findings], None]
