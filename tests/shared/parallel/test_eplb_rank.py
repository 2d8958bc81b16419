"""A rank's side of dynamic EPLB around its controller link (an in-process fake of the
EplbClient interface): what it reports and when."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pdmesh.shared.parallel.eplb_rank import RankEplb
from pdmesh.shared.parallel.expert_load import ExpertLoadRecorder


class Reports:
    def __init__(self):
        self.sent: list[tuple[torch.Tensor, int, int, tuple | None]] = []

    def report(self, counts, step, version, series=None):
        self.sent.append((counts, step, version, series))

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
    with_series = [(step, s) for _, step, _, s in client.sent if s is not None]
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
    assert client.sent and all(s is None for *_, s in client.sent)
