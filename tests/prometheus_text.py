"""Reading Prometheus expositions in tests."""

from __future__ import annotations


def sample(text: str, name: str) -> float:
    """The value of the first sample of ``name`` (a bare name or with labels)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not exported:\n{text[:2000]}")
