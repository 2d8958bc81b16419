"""`pdmesh eplb` as a real process, with EplbClients as the ranks of a group, over loopback:
placements reach every rank, bad reports are refused, and a controller that dies and
comes back on the same port leaves the ranks serving and then reconnects them."""

from __future__ import annotations

import logging
import signal
import time

import grpc
import pytest
import torch

from pdmesh.shared.infra.launcher import Service
from pdmesh.shared.infra.registry import Registry
from pdmesh.shared.parallel.eplb_client import EplbClient, Placement
from pdmesh.shared.proto import common_pb2, eplb_pb2, eplb_pb2_grpc

LAYERS, EXPERTS, SLOTS, RANKS = 2, 8, 12, 2
FAST = dict(num_slots=SLOTS, min_backoff_s=0.05, max_backoff_s=0.3)


@pytest.fixture
def start_controller(tmp_path, registry_prefix):
    """Starts `pdmesh eplb` processes (deciding every 0.2 s); each is stopped at the end."""
    started: list[Service] = []

    def start(port: int = 0) -> Service:
        started.append(Service("eplb", [
            "eplb", "--port", str(port), "--interval-s", "0.2",
            "--registry-prefix", registry_prefix], tmp_path, timeout_s=60))
        return started[-1]

    try:
        yield start
    finally:
        for s in started:
            s.stop()


def hot(layer0: int, layer1: int) -> torch.Tensor:
    """[L, E] counts with one very hot expert per layer."""
    counts = torch.full((LAYERS, EXPERTS), 10, dtype=torch.int64)
    counts[0, layer0] = 1000
    counts[1, layer1] = 800
    return counts


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def stub(service: Service) -> eplb_pb2_grpc.EplbStub:
    return eplb_pb2_grpc.EplbStub(grpc.insecure_channel(service.address))


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def same(a: Placement | None, b: Placement | None) -> bool:
    return (a is not None and b is not None and a.version == b.version
            and torch.equal(a.phy2log, b.phy2log))


def test_both_ranks_get_the_same_better_placement(start_controller, registry_prefix):
    eplb = start_controller()
    s = stub(eplb)
    assert s.Health(common_pb2.HealthRequest(), timeout=5).role == "eplb"
    registered = Registry(prefix=registry_prefix).instances(role="eplb")
    assert eplb.address in [i.address for i in registered]
    with pytest.raises(grpc.RpcError) as e:
        s.Rebalance(eplb_pb2.RebalanceRequest(group="g1"), timeout=5)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    with (EplbClient(eplb.address, "g1", 0, RANKS, **FAST) as r0,
          EplbClient(eplb.address, "g1", 1, RANKS, **FAST) as r1):
        for r in (r0, r1):
            r.report(hot(7, 6), step=1, placement_version=0)
        p0, p1 = r0.wait_for(1, 10), r1.wait_for(1, 10)
        assert p0 is not None and p0.version == 1 and same(p0, p1)
        assert p0.phy2log.shape == (LAYERS, SLOTS) and p0.phy2log.dtype == torch.int64
        assert mean(p0.balancedness_after) > mean(p0.balancedness_before) + 0.05
        # the hot expert now has several slots, spread over both ranks
        assert set(p0.phy2log[0].view(RANKS, -1).eq(7).any(1).tolist()) == {True}

        wait_until(lambda: list(s.Status(eplb_pb2.StatusRequest(group="g1"),
                                         timeout=5).ranks_reporting) == [0, 1])
        status = s.Status(eplb_pb2.StatusRequest(group="g1"), timeout=5)
        assert (status.version, status.num_slots, status.dp_size) == (1, SLOTS, RANKS)
        assert list(status.balancedness) == pytest.approx(p0.balancedness_after)

        again = s.Rebalance(eplb_pb2.RebalanceRequest(group="g1"), timeout=10)
        assert again.version == 1  # nothing to gain: not published
        forced = s.Rebalance(eplb_pb2.RebalanceRequest(group="g1", force=True), timeout=10)
        assert forced.version == 2
        assert same(r0.wait_for(2, 10), r1.wait_for(2, 10)) and r0.latest().version == 2


def test_flash_lb_ranks_send_their_series_and_get_its_placement(start_controller):
    """eplb_policy_type 3 over the wire: each rank's window in stages reaches the
    controller, which places by FlashLB on their sum, and both ranks get it."""
    import numpy as np

    from pdmesh.services.eplb.controller import start_placement
    from pdmesh.shared.parallel.flash_lb import FlashLB

    eplb = start_controller()
    gen = torch.Generator().manual_seed(11)
    series = [torch.randint(0, 30, (8, LAYERS, EXPERTS), generator=gen) for _ in range(RANKS)]
    series[0][1::2, 1, 3] += 500  # layer 1: expert 3 hot in every other stage
    series[1][1::2, 1, 4] += 500  # ... together with expert 4, on the same rank at start
    with (EplbClient(eplb.address, "g4", 0, RANKS, policy=3, **FAST) as r0,
          EplbClient(eplb.address, "g4", 1, RANKS, policy=3, **FAST) as r1):
        for r, own in zip((r0, r1), series, strict=True):
            r.report(own.sum(0), step=8, placement_version=0, series=(own, 2))
        p0, p1 = r0.wait_for(1, 10), r1.wait_for(1, 10)
    assert p0 is not None and same(p0, p1)
    start = start_placement(LAYERS, EXPERTS, SLOTS).view(LAYERS, RANKS, -1).numpy()
    expected, _ = FlashLB().rebalance(start, (series[0] + series[1] + 2).numpy())
    assert p0.phy2log.tolist() == np.asarray(expected).reshape(LAYERS, SLOTS).tolist()
    assert mean(p0.balancedness_after) > mean(p0.balancedness_before)


def test_a_step_driven_round_is_decided_once_every_rank_has_sent_it(start_controller):
    """Numbered reports: no decision (the timer passes the group by) until both ranks
    have closed round 1; then one, published to both."""
    eplb = start_controller()
    s = stub(eplb)
    with (EplbClient(eplb.address, "g5", 0, RANKS, **FAST) as r0,
          EplbClient(eplb.address, "g5", 1, RANKS, **FAST) as r1):
        r0.report(hot(7, 6), step=5, placement_version=0, round_=1)
        r1.report(hot(7, 6), step=5, placement_version=0)  # not yet round 1
        wait_until(lambda: s.Status(eplb_pb2.StatusRequest(group="g5"), timeout=5)
                   .reports == 2)
        time.sleep(1.0)  # five timer ticks
        assert s.Status(eplb_pb2.StatusRequest(group="g5"), timeout=5).decisions == 0
        assert r0.latest() is None
        r1.report(hot(7, 6), step=6, placement_version=0, round_=1)
        p0, p1 = r0.wait_for(1, 10), r1.wait_for(1, 10)
        assert p0 is not None and same(p0, p1)
        assert s.Status(eplb_pb2.StatusRequest(group="g5"), timeout=5).decisions == 1


def test_bad_reports_are_invalid_argument_naming_the_field(start_controller, caplog):
    eplb = start_controller()
    s = stub(eplb)
    good = dict(group="g2", dp_rank=0, dp_size=RANKS, num_layers=LAYERS,
                num_experts=EXPERTS, num_slots=SLOTS, counts=hot(1, 2).flatten().tolist())
    assert s.ReportLoad(eplb_pb2.LoadReport(**good), timeout=5).placement_version == 0
    for field, change in [("counts", {"counts": [1] * 15}), ("dp_rank", {"dp_rank": 2}),
                          ("num_slots", {"num_slots": 16}), ("group", {"group": ""}),
                          ("counts", {"counts": [-1] * 16}),
                          ("stage_counts", {"stage_counts": [1, 2, 3], "stage_steps": 1}),
                          ("stage_counts", {"stage_counts": [-1] * 16, "stage_steps": 1}),
                          ("stage_steps", {"stage_counts": [1] * 16}),
                          ("stage_steps", {"stage_steps": 2})]:
        with pytest.raises(grpc.RpcError) as e:
            s.ReportLoad(eplb_pb2.LoadReport(**{**good, **change}), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(f"{field}: "), e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        next(iter(s.WatchPlacement(eplb_pb2.WatchRequest(group=""), timeout=5)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    # a client's rejected report is logged, never raised at the rank
    caplog.set_level(logging.ERROR, logger="pdmesh.shared.parallel.eplb_client")
    with EplbClient(eplb.address, "g2", 1, RANKS, num_slots=16) as rank:
        rank.report(hot(1, 2), step=1, placement_version=0)
        wait_until(lambda: "num_slots: group 'g2' has num_slots=12" in caplog.text)


def test_ranks_survive_a_dead_controller_and_reconnect(start_controller):
    eplb = start_controller()
    port = int(eplb.address.rsplit(":", 1)[1])
    with (EplbClient(eplb.address, "g3", 0, RANKS, **FAST) as r0,
          EplbClient(eplb.address, "g3", 1, RANKS, **FAST) as r1):
        for r in (r0, r1):
            r.report(hot(7, 6), step=1, placement_version=0)
        before = {r: r.wait_for(1, 10) for r in (r0, r1)}
        assert before[r0] is not None and same(before[r0], before[r1])

        eplb.stop(signal.SIGKILL)
        started = time.monotonic()
        for step in range(2, 12):  # the ranks go on stepping and reporting
            for r in (r0, r1):
                r.report(hot(5, 4), step=step, placement_version=1)
                assert r.latest() is before[r]
            time.sleep(0.05)
        assert time.monotonic() - started < 2.0  # 0.5 s of sleeps: nothing blocked
        ghost = EplbClient(eplb.address, "g3", 0, RANKS, **FAST)  # never connects
        ghost.report(hot(5, 4), step=1, placement_version=0)
        assert ghost.latest() is None
        closing = time.monotonic()
        ghost.close()
        assert time.monotonic() - closing < 2.0
        assert r0.latest() is before[r0] and r1.latest() is before[r1]

        start_controller(port)  # same address: the clients find it by themselves
        after0, after1 = r0.wait_for(2, 15), r1.wait_for(2, 15)
        # the new controller continues above the version the ranks run (1), and places
        # the load reported while it was away (experts 5 and 4 hot)
        assert after0.version == 2 and same(after0, after1)
        assert (after0.phy2log[0] == 5).sum() > 1 and (after0.phy2log[1] == 4).sum() > 1
