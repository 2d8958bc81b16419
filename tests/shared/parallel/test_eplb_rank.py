"""A rank's side of dynamic EPLB around its controller link (an in-process fake of the
EplbClient interface): what it reports and when."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pdmesh.shared.parallel.eplb_rank import Cadence, RankEplb
from pdmesh.shared.parallel.expert_load import ExpertLoadRecorder


class Reports:
    def __init__(self):
        self.sent: list[tuple[torch.Tensor, int, int, tuple | None]] = []

    def report(self, counts, step, version, series=None, round_=0):
        self.sent.append((counts, step, version, series, round_))

    def latest(self):
        return None


def test_a_flash_lb_rank_sends_its_series_once_per_full_window():
    recorder = ExpertLoadRecorder(num_moe_layers=1, num_experts=3, window=4)
    client = Reports()
    rank = RankEplb(SimpleNamespace(version=0), recorder, client, report_every_s=0.0,
                    series=True)
    for step in range(10):
        recorder.record(0, torch.tensor([[step % 3]]))
        recorder.end_step(is_prefill=False)
        rank.at_step_boundary(0, 0)
    with_series = [(step, s) for _, step, _, s, _ in client.sent if s is not None]
    assert [step for step, _ in with_series] == [4, 8]  # full windows, one each
    stages, width = with_series[1][1]
    assert width == 1 and stages[:, 0].argmax(-1).tolist() == [1, 2, 0, 1]  # steps 4..7
    assert len(client.sent) == 10 and all(c.sum() == 4 for c, *_ in client.sent[3:])


def test_other_policies_send_counts_only():
    recorder = ExpertLoadRecorder(1, 3, window=2)
    client = Reports()
    rank = RankEplb(SimpleNamespace(version=0), recorder, client, report_every_s=0.0)
    for _ in range(5):
        recorder.end_step(is_prefill=False)
        rank.at_step_boundary(0, 0)
    assert client.sent and all(s is None for *_, s, _ in client.sent)


class Latest(Reports):
    def __init__(self, version: int):
        super().__init__()
        self.version = version

    def latest(self):
        return SimpleNamespace(version=self.version)


def run_steps(rank: RankEplb, recorder: ExpertLoadRecorder, steps: int,
              stepping: bool = True, prefill: bool = False) -> None:
    for _ in range(steps):
        if stepping:
            recorder.end_step(is_prefill=prefill)
        rank.at_step_boundary(0, 0, stepping)


def test_vllm_ascend_rounds_collect_hold_and_move():
    """expert_heat_collection_interval recorded steps (its phase's), a report numbered
    at once, algorithm_execution_interval steps before a new placement may apply, one
    step per MoE layer, and the next round; idle polls are not steps."""
    recorder = ExpertLoadRecorder(1, 3, window=4, phase="decode")
    client = Latest(version=1)
    rank = RankEplb(SimpleNamespace(version=0), recorder, client, report_every_s=1e9,
                    cadence=Cadence(collect=4, hold=3, move=2, recorded=True))
    run_steps(rank, recorder, 5, stepping=False)  # idle: nothing counts
    run_steps(rank, recorder, 2, prefill=True)  # steps of another phase: not recorded
    run_steps(rank, recorder, 3)
    assert rank.round == 0 and client.sent == []
    assert rank.known_version() == 1  # no hold outside a round's
    run_steps(rank, recorder, 1)  # the 4th decode step closes round 1
    assert rank.round == 1 and [r[-1] for r in client.sent] == [1]
    assert rank.known_version() == 0  # held: the placement it runs
    run_steps(rank, recorder, 3)
    assert rank.known_version() == 1  # the hold is over
    run_steps(rank, recorder, 2 + 3)  # the move, then 3 of the next 4 recorded steps
    assert rank.round == 1
    run_steps(rank, recorder, 1)
    assert rank.round == 2 and [r[-1] for r in client.sent] == [1, 2]


def test_vllm_rounds_every_step_interval_the_first_after_a_quarter():
    recorder = ExpertLoadRecorder(1, 3, window=4)
    client = Reports()
    rank = RankEplb(SimpleNamespace(version=0), recorder, client, report_every_s=1e9,
                    cadence=Cadence(collect=8, first=2))
    closed = []
    for step in range(1, 21):
        run_steps(rank, recorder, 1)
        if client.sent and client.sent[-1][-1] > len(closed):
            closed.append(step)
    assert closed == [2, 10, 18]
