"""The one error ``--additional-config`` parsing raises, listing every problem found."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with the configuration.

    ``key`` is the full dotted path as the user spelled it (``scheduler_config.
    dyntra_lb_config.bubble_threshold``, a deprecated top-level spelling, or a key fed from
    an environment variable, which then names the variable too).
    """

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


class ConfigError(ValueError):
    """The configuration cannot be used; ``problems`` holds every reason, in the order found."""

    def __init__(self, problems: Iterable[ConfigProblem]) -> None:
        self.problems: tuple[ConfigProblem, ...] = tuple(problems)
        if not self.problems:
            raise ValueError("ConfigError needs at least one problem")
        count = len(self.problems)
        header = f"invalid --additional-config ({count} problem{'s' if count > 1 else ''}):"
        super().__init__("\n".join([header, *(f"  - {p}" for p in self.problems)]))

    @property
    def keys(self) -> tuple[str, ...]:
        """The key of every problem, for tests and for log fields."""
        return tuple(p.key for p in self.problems)
