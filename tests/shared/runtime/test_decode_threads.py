"""An engine whose torch threads take every core it may run on decodes on fewer
(``PDMESH_DECODE_FREE_CORES``): the rule, the engine's steps, the serving loop."""

from __future__ import annotations

import pytest
import torch

from pdmesh.shared.engine import EngineConfig, SamplingParams, build_engine
from pdmesh.shared.engine.step_hooks import StepHook, StepRecord
from pdmesh.shared.runtime import loop
from pdmesh.shared.runtime.loop import FREE_CORES_ENV, decode_threads
from tests.shared.runtime.driver import LoopDriver


def test_decode_steps_leave_a_core_only_where_the_engine_takes_them_all():
    assert decode_threads(2, 2, {}) == 1
    assert decode_threads(16, 16, {}) == 15
    assert decode_threads(8, 16, {}) == 0  # (a share of the box: cores are left already)
    assert decode_threads(1, 1, {}) == 0
    assert decode_threads(4, 4, {FREE_CORES_ENV: "0"}) == 0
    assert decode_threads(4, 4, {FREE_CORES_ENV: "2"}) == 2
    assert decode_threads(4, 4, {FREE_CORES_ENV: "9"}) == 1
    for bad in ("x", "-1", "1.5"):
        with pytest.raises(ValueError, match=FREE_CORES_ENV):
            decode_threads(4, 4, {FREE_CORES_ENV: bad})


class Threads(StepHook):
    """Each step's prompt tokens and the torch threads its forward ran on."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def executed(self, step: StepRecord) -> None:
        self.seen.append((step.prompt_tokens, torch.get_num_threads()))


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def on_two_threads(driver: LoopDriver) -> LoopDriver:
    """The driver's loop started on 2 torch threads (OpenMP's thread count is a thread's
    own: the loop's thread sets it, as an engine process's main thread has it)."""
    driver._thread.run = lambda: (torch.set_num_threads(2), driver.loop.run())
    driver.start()
    return driver


def test_a_serving_loop_on_every_core_decodes_on_one_fewer(qwen3_path, two_threads,
                                                          monkeypatch):
    monkeypatch.setattr(loop, "usable_cores", lambda: 2)  # (the engine's 2 are all)
    eng = build_engine(EngineConfig(model=str(qwen3_path), device="cpu", dtype="float32",
                                    max_num_batched_tokens=64))
    hook = Threads()
    eng.hooks.append(hook)
    driver = on_two_threads(LoopDriver(eng, start=False))
    try:
        tokens, _ = driver.submit(list(range(10, 110)), SamplingParams(
            temperature=0, max_tokens=5, ignore_eos=True)).drain()
        assert len(tokens) == 5
    finally:
        driver.stop()
    assert eng.decode_threads == 1
    # 100 prompt tokens in chunks of 64 on both threads, then each decode step on one
    assert [n for p, n in hook.seen if p] == [2, 2]
    assert [n for p, n in hook.seen if not p] == [1] * 4


def test_an_engine_with_a_core_to_spare_keeps_its_threads(qwen3_path, two_threads,
                                                         monkeypatch):
    monkeypatch.setattr(loop, "usable_cores", lambda: 4)
    eng = build_engine(EngineConfig(model=str(qwen3_path), device="cpu", dtype="float32"))
    hook = Threads()
    eng.hooks.append(hook)
    driver = on_two_threads(LoopDriver(eng, start=False))
    try:
        driver.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=4,
                                                ignore_eos=True)).drain()
    finally:
        driver.stop()
    assert eng.decode_threads == 0
    assert {n for _, n in hook.seen} == {2}
