"""A prefill and a decode engine of one box taking turns on its cores (`pdmesh up`):
the file they meet in, across processes, and both loops' sides of it."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time

import pytest

from pdmesh.shared.cli.up import _shared_cores
from pdmesh.shared.engine import EngineConfig, SamplingParams, build_engine
from pdmesh.shared.runtime import shared_cores
from pdmesh.shared.runtime.shared_cores import BELOW_ENV, PATH_ENV, YIELD_ENV, SharedCores, create
from tests.shared.runtime.driver import LoopDriver


@pytest.fixture
def path(tmp_path):
    p = str(tmp_path / "cores")
    create(p)
    return p


def publish_from_another_process(path: str, tokens: int) -> None:
    subprocess.run([sys.executable, "-c",
                    "import sys; from pdmesh.shared.runtime.shared_cores import SharedCores; "
                    "SharedCores(sys.argv[1]).publish(int(sys.argv[2]))", path, str(tokens)],
                   check=True, timeout=60)


def test_a_prefill_engines_work_left_is_seen_by_a_decode_engine(path):
    decode = SharedCores(path)
    assert not decode.prefill_busy() and decode.pause_after(0.004) == 0.0
    publish_from_another_process(path, 1500)
    assert decode.prefill_busy()
    assert decode.pause_after(0.004) == pytest.approx(2 * 0.004)
    assert SharedCores(path, yield_factor=0.0).pause_after(0.004) == 0.0
    # prefill backed up (1,500 tokens left >= below): decode steps on, as offload begins
    assert SharedCores(path, 1.0, below=1000).pause_after(0.004) == 0.0
    assert SharedCores(path, 1.0, below=2048).pause_after(0.004) == pytest.approx(0.004)
    # a TPOT budget caps the step and the pause together
    assert SharedCores(path, 10.0).pause_after(0.004, 10.0) == pytest.approx(0.006)
    assert SharedCores(path, 10.0).pause_after(0.012, 10.0) == 0.0  # (the step alone is over)
    assert SharedCores(path, 1.0).pause_after(0.004, 50.0) == pytest.approx(0.004)
    assert decode.prefill_left() == 1500
    # a prefill engine steps on all its threads while decode yields, one when backed up
    assert SharedCores(path, 1.0, below=2048).prefill_threads(2047, 4) == 4
    assert SharedCores(path, 1.0, below=2048).prefill_threads(2048, 4) == 1
    assert SharedCores(path, 1.0).prefill_threads(10 ** 6, 4) == 4  # (never backed up)
    # a slot written long ago (its engine gone, work left) counts as idle
    slot = shared_cores._SLOT
    for at in range(0, slot.size * shared_cores.SLOTS, slot.size):
        left, _ = slot.unpack_from(decode._map, at)
        if left:
            slot.pack_into(decode._map, at, left, time.monotonic() - shared_cores.STALE_S - 1)
    assert not decode.prefill_busy()


def test_from_env(path):
    assert SharedCores.from_env({}) is None
    assert SharedCores.from_env({PATH_ENV: path}) is None  # (no factor asked for)
    assert SharedCores.from_env({PATH_ENV: path, YIELD_ENV: "0"}) is None
    assert SharedCores.from_env({PATH_ENV: path, YIELD_ENV: "3"}).yield_factor == 3.0
    assert SharedCores.from_env({PATH_ENV: path, YIELD_ENV: "1"}).below == 0
    assert SharedCores.from_env({PATH_ENV: path, YIELD_ENV: "1", BELOW_ENV: "2048"}).below \
        == 2048
    with pytest.raises(ValueError, match=BELOW_ENV):
        SharedCores.from_env({PATH_ENV: path, YIELD_ENV: "1", BELOW_ENV: "lots"})
    for bad in ("fast", "-1"):
        with pytest.raises(ValueError, match=YIELD_ENV):
            SharedCores.from_env({PATH_ENV: path, YIELD_ENV: bad})


def test_up_names_a_file_only_when_asked_for_prefill_beside_decode(tmp_path, monkeypatch):
    pd = [("prefill", 1), ("decode", 1)]
    monkeypatch.delenv(YIELD_ENV, raising=False)
    assert _shared_cores(pd, str(tmp_path)) == {}  # off by default
    monkeypatch.setenv(YIELD_ENV, "1.5")
    monkeypatch.delenv(BELOW_ENV, raising=False)
    env = _shared_cores(pd, str(tmp_path), 2048)
    assert SharedCores(env[PATH_ENV]).prefill_busy() is False  # created, every slot idle
    assert env[BELOW_ENV] == "2048"  # the offload threshold: decode steps on past it
    monkeypatch.setenv(BELOW_ENV, "512")
    assert _shared_cores(pd, str(tmp_path), 2048)[BELOW_ENV] == "512"
    assert _shared_cores([("mixed", 1)], str(tmp_path)) == {}
    assert _shared_cores([("prefill", 1), ("decode", 0)], str(tmp_path)) == {}
    monkeypatch.setenv(YIELD_ENV, "0")
    assert _shared_cores(pd, str(tmp_path)) == {}
    monkeypatch.setenv(YIELD_ENV, "soon")
    with pytest.raises(ValueError, match=YIELD_ENV):
        _shared_cores(pd, str(tmp_path))


class Recording(SharedCores):
    def __init__(self, path):
        super().__init__(path)
        self.published: list[int] = []
        self.pauses: list[tuple[float, float]] = []

    def publish(self, prompt_tokens_left: int) -> None:
        self.published.append(prompt_tokens_left)
        super().publish(prompt_tokens_left)

    def pause_after(self, step_s: float, budget_ms: float = 0.0) -> float:
        pause = super().pause_after(step_s, budget_ms)
        self.pauses.append((step_s, pause))
        return pause


def engine(qwen3_path, **kw):
    return build_engine(EngineConfig(model=str(qwen3_path), device="cpu", dtype="float32",
                                     block_size=16, **kw))


def test_a_prefill_loop_publishes_its_prompt_tokens_left(qwen3_path, path):
    driver = LoopDriver(engine(qwen3_path, max_num_batched_tokens=64), start=False)
    driver.loop.cores, driver.loop.cores_role = Recording(path), "prefill"
    driver.start()
    try:
        tokens, _ = driver.submit(list(range(10, 310)), SamplingParams(
            temperature=0, max_tokens=1)).drain()
        assert len(tokens) == 1
        seen = [n for n in driver.loop.cores.published if n]
        # 300 prompt tokens, 64 a step: what is left before the first step (the step is
        # what decode yields to), then after each chunk, then nothing
        assert seen[0] == 300
        assert sorted(set(seen), reverse=True)[:5] == [300, 236, 172, 108, 44]
        time.sleep(0.2)
        assert driver.loop.cores.published[-1] == 0
    finally:
        driver.stop()


def test_a_prefill_loop_steps_on_one_thread_while_backed_up(qwen3_path, path):
    driver = LoopDriver(engine(qwen3_path, max_num_batched_tokens=64), start=False)
    driver.loop.cores, driver.loop.cores_role = SharedCores(path, 1.0, below=200), "prefill"
    threads: list[int] = []
    driver.loop._set_threads = threads.append
    driver.loop._full_threads = 3
    driver.start()
    try:
        driver.submit(list(range(10, 310)), SamplingParams(temperature=0, max_tokens=1)
                      ).drain()
        # 300 and 236 tokens left before those steps (>= 200): one thread; then all
        # (every turn, idle ones too, says how many)
        runs = [n for n, _ in itertools.groupby(threads)]
        assert runs[runs.index(1):][:2] == [1, 3] and threads.count(1) == 2
    finally:
        driver.stop()


def test_a_decode_loop_yields_while_prefill_has_work(qwen3_path, path):
    driver = LoopDriver(engine(qwen3_path), start=False)
    cores = driver.loop.cores = Recording(path)
    driver.loop.cores_role = "decode"
    driver.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        driver.submit([5, 6, 7], params).drain()
        assert cores.pauses and all(p == 0.0 for _, p in cores.pauses)  # prefill idle
        cores.pauses.clear()
        publish_from_another_process(path, 4000)
        driver.submit([5, 6, 7], params).drain()
        assert cores.pauses and all(p == pytest.approx(2 * s) and p > 0
                                    for s, p in cores.pauses)
    finally:
        driver.stop()


def test_a_yielding_decode_loop_steps_on_once_prefill_is_done_or_a_request_comes(
        qwen3_path, path):
    driver = LoopDriver(engine(qwen3_path), start=False)
    driver.loop.cores, driver.loop.cores_role = SharedCores(path, yield_factor=1000.0), "decode"
    prefill = SharedCores(path)
    prefill.publish(500)
    # prefill busy: a 1 ms step would pause a second, but prefill finishes in 0.1 s
    threading.Timer(0.1, prefill.publish, (0,)).start()
    t0 = time.monotonic()
    driver.loop._yield(0.001)
    assert 0.09 < time.monotonic() - t0 < 0.5
    # and a request arriving while prefill is still busy ends the pause too
    prefill.publish(500)
    threading.Timer(0.1, driver.port.put, (None,)).start()
    t0 = time.monotonic()
    driver.loop._yield(0.001)
    assert 0.09 < time.monotonic() - t0 < 0.5
    prefill.publish(0)
