"""The expert-load window: counts per (MoE layer, expert), phase filter, sliding window."""

from __future__ import annotations

import pytest
import torch

from pdmesh.shared.parallel.expert_load import ExpertLoadRecorder


def test_counts_per_layer_and_expert_over_the_window():
    r = ExpertLoadRecorder(num_moe_layers=2, num_experts=4, window=2)
    r.record(0, torch.tensor([[0, 1], [1, 3]]))
    r.record(1, torch.tensor([[2, 2]]))  # the same expert twice counts twice
    r.end_step(is_prefill=True)
    assert r.load().tolist() == [[1, 2, 0, 1], [0, 0, 2, 0]]
    r.record(0, torch.tensor([[3, 0]]))
    r.end_step(is_prefill=False)
    assert r.load().tolist() == [[2, 2, 0, 2], [0, 0, 2, 0]]
    r.end_step(is_prefill=False)  # an empty step pushes the first one out of the window
    assert r.load().tolist() == [[1, 0, 0, 1], [0, 0, 0, 0]]
    assert r.steps == 3


@pytest.mark.parametrize("phase,kept", [("prefill", [[1, 0]]), ("decode", [[0, 1]]),
                                        ("all", [[1, 1]])])
def test_phase_filter(phase, kept):
    r = ExpertLoadRecorder(1, 2, window=4, phase=phase)
    r.record(0, torch.tensor([[0]]))
    r.end_step(is_prefill=True)
    r.record(0, torch.tensor([[1]]))
    r.end_step(is_prefill=False)
    assert r.load().tolist() == kept


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="window"):
        ExpertLoadRecorder(1, 2, window=0)
    with pytest.raises(ValueError, match="phase"):
        ExpertLoadRecorder(1, 2, window=1, phase="both")


def test_series_is_the_window_oldest_first_in_equal_stages():
    """None until the window is full; then the steps in order, summed in stages of
    window // stages steps, the oldest leftover steps dropped."""
    r = ExpertLoadRecorder(1, 2, window=5)
    for step in range(7):  # step s routes s tokens to expert 0 and one to expert 1
        if step == 4:
            assert r.series() is None
        r.record(0, torch.tensor([[0]] * step + [[1]]))
        r.end_step(is_prefill=False)
    stages, width = r.series(max_stages=64)  # the window holds steps 2..6
    assert width == 1 and stages[:, 0].tolist() == [[s, 1] for s in range(2, 7)]
    stages, width = r.series(max_stages=2)  # two stages of two steps; step 2 dropped
    assert width == 2 and stages[:, 0].tolist() == [[3 + 4, 2], [5 + 6, 2]]
