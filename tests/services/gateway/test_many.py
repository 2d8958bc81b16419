"""Several answers in one: when one choice fails, the others stop before the error is
answered (none runs on, unanswered, holding its KV)."""

from __future__ import annotations

import asyncio

import pytest

from pdmesh.services.gateway.app import _all
from pdmesh.services.gateway.errors import MeshError


def test_one_failing_choice_stops_the_others():
    stopped: list[str] = []

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise MeshError("decode instance gone", 503)

    async def long(name: str) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            stopped.append(name)
            raise

    async def main() -> None:
        with pytest.raises(MeshError, match="gone"):
            await _all([long("a"), fails(), long("b")])

    asyncio.run(asyncio.wait_for(main(), 5))
    assert sorted(stopped) == ["a", "b"]


def test_all_results_in_order():
    async def value(v: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return v

    assert asyncio.run(_all([value(1, 0.02), value(2, 0.0), value(3, 0.01)])) == [1, 2, 3]
