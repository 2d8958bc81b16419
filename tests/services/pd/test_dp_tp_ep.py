"""A decode instance of two data-parallel ranks at tensor-parallel size 2, the MoE
experts placed over all four rank processes, behind the gateway: every answer equals the
single-process engine's, and stopping the instance stops every process, the TP workers
too."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.processes import alive
from tests.services.pd.test_data_parallel import concurrent_answers, moe_mesh, offline_answers


@pytest.fixture(scope="module")
def mesh(tiny_models, tmp_path_factory, registry_prefix):
    with moe_mesh(str(tiny_models["qwen3_moe"]), tmp_path_factory.mktemp("dp-tp-logs"),
                  registry_prefix + "-dptp", ["--tensor-parallel-size", "2"],
                  ["--data-parallel-size", "2", "--tensor-parallel-size", "2",
                   "--enable-expert-parallel"]) as m:
        yield m


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_dp2_tp2_ep_decode_answers_as_one_process(mesh, tiny_models):
    assert concurrent_answers(mesh["url"]) == offline_answers(str(tiny_models["qwen3_moe"]))


def test_stopping_the_instance_stops_every_rank_and_worker(mesh):
    ranks = mesh["decode"].info["pids"]
    workers = [c for p in ranks for c in children(p)  # each rank's spawned TP worker
               if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
    assert len(ranks) == 2 and len(workers) == 2, (ranks, workers)
    mesh["decode"].stop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in ranks + workers):
        time.sleep(0.1)
    assert not any(alive(p) for p in ranks + workers)
