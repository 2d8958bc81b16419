"""The EPLB controller's logic (services/eplb/controller.py), without a network."""

from __future__ import annotations

import threading

import pytest
import torch

from pdmesh.services.eplb.controller import (
    EplbController,
    LoadSample,
    NoLoadError,
    placement_balancedness,
    replica_counts,
    stage_balancedness,
    start_placement,
)
from pdmesh.shared.parallel.rebalance import balancedness, rebalance_experts

LAYERS, EXPERTS, SLOTS, RANKS = 2, 8, 12, 2


def sample(counts: torch.Tensor, dp_rank: int = 0, group: str = "g", **kw) -> LoadSample:
    fields = dict(dp_size=RANKS, num_layers=LAYERS, num_experts=EXPERTS, num_slots=SLOTS)
    fields.update(kw)
    return LoadSample(group, dp_rank, counts=counts, **fields)


def uniform() -> torch.Tensor:
    return torch.full((LAYERS, EXPERTS), 100, dtype=torch.int64)  # [L, E]


def skewed() -> torch.Tensor:
    """Expert 7 (layer 0) and 6 (layer 1) hot: each has one slot at the start, on rank 1."""
    counts = torch.full((LAYERS, EXPERTS), 10, dtype=torch.int64)
    counts[0, 7] = 1000
    counts[1, 6] = 800
    return counts


def mean(xs) -> float:
    return sum(xs) / len(xs)


def test_start_placement_wraps_redundant_slots():
    assert start_placement(1, 4, 6).tolist() == [[0, 1, 2, 3, 0, 1]]
    assert replica_counts(start_placement(1, 4, 6), 4).tolist() == [[2, 2, 1, 1]]


def test_load_is_the_sum_of_each_ranks_latest_report():
    c = EplbController()
    first, second = skewed(), uniform()
    c.report(sample(uniform(), dp_rank=0))
    c.report(sample(first, dp_rank=0))  # replaces rank 0's earlier report
    c.report(sample(second, dp_rank=1))
    assert torch.equal(c.load("g"), first + second)
    d = c.decide("g", force=True)
    proposal = rebalance_experts(first + second, SLOTS, 1, 1, RANKS)
    assert torch.equal(d.phy2log, proposal.phy2log)
    expected = balancedness(first + second, proposal.phy2log, proposal.logcnt, RANKS)
    assert d.proposed == pytest.approx(expected.tolist())
    status = c.status("g")
    assert (status.reports, status.ranks_reporting, status.version) == (3, (0, 1), 1)
    assert status.shape == dict(dp_size=RANKS, num_layers=LAYERS, num_experts=EXPERTS,
                                num_slots=SLOTS)


def test_groups_are_independent():
    c = EplbController()
    c.report(sample(skewed(), group="a"))
    c.report(sample(uniform(), group="b", num_slots=8))
    assert c.groups() == ["a", "b"]
    assert c.decide("a").published and c.placement("b") is None
    assert c.status("b").version == 0


def test_skewed_load_publishes_a_better_placement():
    c = EplbController(improvement_threshold=0.05)
    published = []
    c.add_listener(published.append)
    c.report(sample(skewed(), dp_rank=0))
    c.report(sample(skewed(), dp_rank=1))
    d = c.decide("g")
    assert d.published and d.version == 1
    assert mean(d.proposed) > mean(d.current) + 0.05
    start = placement_balancedness(c.load("g"), start_placement(LAYERS, EXPERTS, SLOTS), RANKS)
    assert d.current == pytest.approx(start)  # "before" is the assumed start placement
    [p] = published
    assert p.version == 1 and torch.equal(p.phy2log, d.phy2log)
    assert p.balancedness_before == d.current and p.balancedness_after == d.proposed
    assert c.placement("g") is p
    assert c.status("g").balancedness == pytest.approx(d.proposed)


def test_small_improvement_is_not_published():
    c = EplbController(improvement_threshold=0.05)
    published = []
    c.add_listener(published.append)
    c.report(sample(uniform()))  # the start placement is already perfectly balanced
    d = c.decide("g")
    assert not d.published and d.version == 0 and published == []
    assert torch.equal(d.phy2log, start_placement(LAYERS, EXPERTS, SLOTS))
    assert d.after == d.current and c.placement("g") is None
    assert c.status("g").decisions == 1


def test_threshold_decides_between_publishing_and_not():
    gain = None
    for threshold in (0.99, 0.0):
        c = EplbController(improvement_threshold=threshold)
        c.report(sample(skewed()))
        d = c.decide("g")
        gain = mean(d.proposed) - mean(d.current)
        assert d.published == (gain > threshold), (threshold, gain)
    assert 0.0 < gain < 0.99  # so the two runs above went opposite ways


def test_an_applied_placement_is_not_republished():
    c = EplbController()
    c.report(sample(skewed()))
    assert c.decide("g").published
    c.report(sample(skewed() * 3, placement_version=1))  # same shape of load
    d = c.decide("g")
    assert not d.published and d.version == 1
    assert d.current == pytest.approx(d.proposed)


def test_force_publishes_and_versions_increase_by_one():
    c = EplbController(improvement_threshold=0.05)
    c.report(sample(uniform()))
    versions = [c.decide("g", force=True).version for _ in range(3)]
    assert versions == [1, 2, 3] and c.placement("g").version == 3
    assert not c.decide("g").published and c.status("g").version == 3


def test_restarted_controller_versions_above_what_ranks_run_and_resyncs():
    """A restarted controller must not reuse a version the ranks run; not knowing their
    placement, it publishes its first proposal even when it gains nothing."""
    c = EplbController(improvement_threshold=0.05)
    assert c.report(sample(uniform(), placement_version=7)) == 7
    d = c.decide("g")
    assert d.published and d.version == 8 and c.placement("g").version == 8
    assert not c.decide("g").published  # known again: the threshold applies


def test_no_load_no_decision():
    with pytest.raises(NoLoadError, match="group"):
        EplbController().decide("nobody")
    assert EplbController().status("nobody").version == 0


@pytest.mark.parametrize("field,kw", [
    ("dp_size", {"dp_size": 4, "num_slots": 12}),
    ("num_layers", {"num_layers": 3}),
    ("num_experts", {"num_experts": 4}),
    ("num_slots", {"num_slots": 16}),
])
def test_report_disagreeing_with_the_group_is_rejected(field, kw):
    c = EplbController()
    c.report(sample(skewed(), dp_rank=0))
    counts = torch.ones(kw.get("num_layers", LAYERS), kw.get("num_experts", EXPERTS),
                        dtype=torch.int64)
    with pytest.raises(ValueError, match=f"^{field}: group 'g' has {field}="):
        c.report(sample(counts, dp_rank=1, **kw))
    assert c.status("g").ranks_reporting == (0,)


@pytest.mark.parametrize("field,kw", [
    ("group", {"group": ""}),
    ("dp_rank", {"dp_rank": 2}),
    ("dp_size", {"dp_size": 0}),
    ("num_slots", {"num_slots": 6}),  # fewer than the experts
    ("num_slots", {"num_slots": 9}),  # not a multiple of dp_size
    ("counts", {"counts": torch.ones(LAYERS, EXPERTS + 1, dtype=torch.int64)}),
    ("counts", {"counts": -torch.ones(LAYERS, EXPERTS, dtype=torch.int64)}),
    ("step", {"step": -1}),
    ("placement_version", {"placement_version": -1}),
])
def test_bad_sample_names_the_field(field, kw):
    kw.setdefault("counts", uniform())
    with pytest.raises(ValueError, match=f"^{field}: "):
        sample(**kw)


def test_from_flat_checks_the_count_of_counts():
    s = LoadSample.from_flat("g", 0, RANKS, LAYERS, EXPERTS, SLOTS, list(range(16)))
    assert s.counts.tolist()[1] == list(range(8, 16))
    with pytest.raises(ValueError, match="^counts: must hold num_layers"):
        LoadSample.from_flat("g", 0, RANKS, LAYERS, EXPERTS, SLOTS, [1] * 15)
    with pytest.raises(ValueError, match="^num_layers: "):
        LoadSample.from_flat("g", 0, RANKS, 0, EXPERTS, SLOTS, [])


def test_controller_flags_must_split_the_group():
    with pytest.raises(ValueError, match="^num_experts: .*--num-groups"):
        EplbController(num_groups=3).report(sample(uniform()))
    with pytest.raises(ValueError, match="^dp_size: .*--num-nodes"):
        EplbController(num_nodes=4).report(sample(uniform()))
    with pytest.raises(ValueError, match="^improvement_threshold"):
        EplbController(improvement_threshold=-1)


def test_concurrent_reports_and_decisions():
    c = EplbController(improvement_threshold=0.0)
    published = []
    c.add_listener(lambda p: published.append(p.version))
    errors = []

    def rank(r: int) -> None:
        try:
            for i in range(30):
                counts = skewed() if i % 2 else uniform()
                c.report(sample(counts, dp_rank=r, step=i))
                c.decide("g", force=i % 5 == 0)
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(RANKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert published == list(range(1, len(published) + 1))  # in order, none skipped
    assert c.status("g").decisions == 60 and c.status("g").reports == 60


def test_each_group_places_by_its_own_eplb_policy():
    """vLLM-Ascend's eplb_policy_type, from the group's reports: 2 SwiftBalance from the
    placement in force, 0 the test swap (4 ranks or more), None or 1 DeepSeek's; a rank
    naming another policy than its group's is refused."""
    from pdmesh.shared.parallel.swift_balance import swap_test, swift_balance

    c = EplbController(improvement_threshold=0.0)
    for group, policy in (("swift", 2), ("deepseek", None), ("one", 1)):
        for rank in range(RANKS):
            c.report(sample(skewed(), dp_rank=rank, group=group, policy=policy))
    start = start_placement(LAYERS, EXPERTS, SLOTS)
    load = c.load("swift")
    swift = c.decide("swift", force=True)
    assert torch.equal(swift.phy2log, swift_balance(start, load, RANKS))
    assert not torch.equal(swift.phy2log, start)
    deepseek = rebalance_experts(load, SLOTS, 1, 1, RANKS).phy2log
    for group in ("deepseek", "one"):
        assert torch.equal(c.decide(group, force=True).phy2log, deepseek)
    # SwiftBalance goes on from the placement it published
    again = c.decide("swift", force=True)
    assert torch.equal(again.phy2log, swift_balance(swift.phy2log, load, RANKS))
    for rank in range(4):
        c.report(sample(skewed(), dp_rank=rank, group="test", policy=0, dp_size=4))
    assert torch.equal(c.decide("test", force=True).phy2log, swap_test(start, 4))
    with pytest.raises(ValueError, match="eplb_policy_type: group 'swift' runs 2"):
        c.report(sample(skewed(), group="swift", policy=1))
    with pytest.raises(ValueError, match="eplb_policy_type: must be one of"):
        sample(skewed(), policy=7)


def test_flash_lb_places_on_the_ranks_series():
    """Policy 3: nothing moves until a rank sends its window stage by stage; then the
    ranks' series, summed (the newest stages they share) plus one per step, go to
    FlashLB, which remembers the layers' ratios between decisions."""
    from pdmesh.shared.parallel.flash_lb import FlashLB

    c = EplbController(improvement_threshold=0.0)
    for rank in range(RANKS):
        c.report(sample(skewed(), dp_rank=rank, policy=3))
    start = start_placement(LAYERS, EXPERTS, SLOTS)
    assert torch.equal(c.decide("g", force=True).phy2log, start)  # no series yet
    gen = torch.Generator().manual_seed(3)
    series = [torch.randint(0, 50, (6, LAYERS, EXPERTS), generator=gen) for _ in range(2)]
    series[0][::2, 0, 7] += 400  # expert 7 hot every other stage on rank 0's share
    c.report(sample(skewed(), dp_rank=0, policy=3, stages=series[0], stage_steps=4))
    c.report(sample(skewed(), dp_rank=1, policy=3, stages=series[1][1:], stage_steps=4))
    c.report(sample(skewed(), dp_rank=1, policy=3))  # no series: rank 1's last one stands
    hotness = series[0][1:] + series[1][1:] + 4
    reference = FlashLB()
    table = start.view(LAYERS, RANKS, -1).numpy()
    expected, _ = reference.rebalance(table, hotness.numpy())
    d = c.decide("g", force=True)
    assert d.phy2log.tolist() == expected.reshape(LAYERS, SLOTS).tolist()
    assert not torch.equal(d.phy2log, start)
    # judged stage by stage, as FlashLB aims
    assert d.proposed == stage_balancedness(hotness, d.phy2log, RANKS)
    assert d.current == stage_balancedness(hotness, start, RANKS)
    assert mean(d.proposed) > mean(d.current)
    expected, _ = reference.rebalance(expected, hotness.numpy())  # its memory goes on
    assert c.decide("g", force=True).phy2log.tolist() == expected.reshape(
        LAYERS, SLOTS).tolist()
    with pytest.raises(ValueError, match="stage_steps: must be positive"):
        sample(skewed(), policy=3, stages=series[0])
    with pytest.raises(ValueError, match="stage_counts: must hold a multiple"):
        LoadSample.from_flat("g", 0, RANKS, LAYERS, EXPERTS, SLOTS, [0] * LAYERS * EXPERTS,
                             stage_counts=[1, 2, 3], stage_steps=1)


def test_step_driven_groups_decide_when_every_rank_closes_a_round():
    """Reports numbered by round: due once every rank has sent the round (each round
    once), and the timer passes such a group by."""
    c = EplbController(improvement_threshold=0.0)
    c.report(sample(skewed(), dp_rank=0, decide_round=1))
    assert not c.take_due_round("g")  # rank 1 has not closed it
    c.report(sample(skewed(), dp_rank=1))  # an unnumbered report: still not
    assert not c.take_due_round("g")
    c.report(sample(skewed(), dp_rank=1, decide_round=1))
    assert c.take_due_round("g") and not c.take_due_round("g")
    c.report(sample(skewed(), dp_rank=0, decide_round=2))
    c.report(sample(skewed(), dp_rank=0, decide_round=1))  # an older one keeps round 2
    c.report(sample(skewed(), dp_rank=1, decide_round=2))
    assert c.take_due_round("g")
    for rank in range(RANKS):
        c.report(sample(skewed(), dp_rank=rank, group="timed"))
    assert [d.group for d in c.decide_all()] == ["timed"]
    assert not c.take_due_round("timed") and not c.take_due_round("nobody")
    with pytest.raises(ValueError, match="decide_round: must be non-negative"):
        sample(skewed(), decide_round=-1)


def test_the_timer_waits_for_every_rank_before_it_places():
    """A timer-driven group is not decided on a part of its ranks' load (the ranks that
    have not reported yet may carry the hot experts); a forced Rebalance still is."""
    c = EplbController(improvement_threshold=0.0)
    c.report(sample(skewed(), dp_rank=0))
    assert c.decide_all() == [] and c.placement("g") is None
    c.report(sample(uniform(), dp_rank=1))
    assert [d.group for d in c.decide_all()] == ["g"]
    c.report(sample(skewed(), dp_rank=0, group="half"))
    assert c.decide("half", force=True).published
