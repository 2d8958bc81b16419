"""Unit tests for the EPLB placement algorithm (services/eplb/algorithm.py)."""

from __future__ import annotations

import pytest
import torch

from pdmesh.shared.parallel.rebalance import ExpertPlacement, balancedness, rebalance_experts

# (num_replicas, num_groups, num_nodes, num_ranks) for 16 logical experts.
HIERARCHICAL = [(16, 4, 2, 4), (24, 4, 2, 4), (24, 8, 4, 8), (32, 4, 4, 8), (20, 2, 1, 4)]
# Global policy: num_groups % num_nodes != 0.
GLOBAL = [(24, 2, 4, 8), (32, 1, 2, 4), (24, 4, 3, 6), (18, 2, 3, 3)]
NUM_LOGICAL = 16


def skewed_load(num_layers: int, num_logical: int, seed: int) -> torch.Tensor:
    """[num_layers, num_logical] integer token counts with a few very hot experts."""
    g = torch.Generator().manual_seed(seed)
    heat = torch.rand(num_layers, num_logical, generator=g).pow(4)
    return (heat * 10_000).round().to(torch.int64) + 1


def zipf_load(num_layers: int, num_logical: int, seed: int, s: float = 1.2) -> torch.Tensor:
    """Tokens per expert drawn from a Zipf law over a random ranking of the experts in
    each layer (MoE routing in real models is roughly Zipf-like)."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, num_logical + 1, dtype=torch.float64).pow(s)
    rows = []
    for _ in range(num_layers):
        ranks = torch.randperm(num_logical, generator=g)
        draws = torch.multinomial(weights, 20_000, replacement=True, generator=g)
        rows.append(torch.bincount(ranks[draws], minlength=num_logical))
    return torch.stack(rows)


def random_load(num_layers: int, num_logical: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 5_000, (num_layers, num_logical), generator=g)


def identity_placement(num_layers: int, num_logical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """No redundancy: expert i on slot i. Returns (phy2log, logcnt)."""
    phy2log = torch.arange(num_logical).expand(num_layers, num_logical).clone()
    return phy2log, torch.ones(num_layers, num_logical, dtype=torch.int64)


def assert_consistent(placement: ExpertPlacement, num_logical: int, num_replicas: int,
                      num_ranks: int) -> None:
    """The invariants ExpertPlacement documents, checked slot by slot."""
    phy2log, log2phy, logcnt = placement
    num_layers = phy2log.shape[0]
    slots_per_rank = num_replicas // num_ranks
    assert (logcnt >= 1).all()
    assert (logcnt.sum(1) == num_replicas).all()
    assert torch.equal(logcnt, torch.stack([row.bincount(minlength=num_logical)
                                            for row in phy2log]))
    for layer in range(num_layers):
        listed = []
        for expert in range(num_logical):
            row = log2phy[layer, expert]
            count = int(logcnt[layer, expert])
            slots = row[:count]
            assert (row[count:] == -1).all(), "padding must be -1, and only at the end"
            assert (slots >= 0).all()
            assert torch.equal(slots, slots.sort().values), "slots must be ascending"
            assert (phy2log[layer, slots] == expert).all()
            listed.extend(slots.tolist())
        assert sorted(listed) == list(range(num_replicas)), "every slot listed exactly once"
        ranks = torch.tensor(listed) // slots_per_rank
        assert ranks.bincount(minlength=num_ranks).tolist() == [slots_per_rank] * num_ranks


# -- shapes and invariants ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.float64])
@pytest.mark.parametrize("config", HIERARCHICAL + GLOBAL)
def test_shapes_dtypes_and_invariants(config: tuple[int, int, int, int],
                                      dtype: torch.dtype) -> None:
    num_replicas, num_groups, num_nodes, num_ranks = config
    weight = skewed_load(3, NUM_LOGICAL, seed=sum(config)).to(dtype)
    placement = rebalance_experts(weight, *config)
    phy2log, log2phy, logcnt = placement
    assert phy2log.shape == (3, num_replicas)
    assert log2phy.shape == (3, NUM_LOGICAL, num_replicas - NUM_LOGICAL + 1)
    assert logcnt.shape == (3, NUM_LOGICAL)
    for tensor in placement:
        assert tensor.dtype == torch.int64
        assert tensor.device.type == "cpu"
    assert_consistent(placement, NUM_LOGICAL, num_replicas, num_ranks)


def test_integer_and_float_weights_give_the_same_placement() -> None:
    weight = skewed_load(4, NUM_LOGICAL, seed=3)
    by_int = rebalance_experts(weight, 24, 4, 2, 4)
    by_float = rebalance_experts(weight.to(torch.float32), 24, 4, 2, 4)
    for a, b in zip(by_int, by_float, strict=True):
        assert torch.equal(a, b)


def test_deterministic() -> None:
    weight = skewed_load(5, NUM_LOGICAL, seed=4)
    first = rebalance_experts(weight, 24, 4, 2, 4)
    again = rebalance_experts(weight.clone(), 24, 4, 2, 4)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


def test_does_not_modify_weight() -> None:
    weight = skewed_load(2, NUM_LOGICAL, seed=5).to(torch.float64)
    before = weight.clone()
    rebalance_experts(weight, 24, 4, 2, 4)
    assert torch.equal(weight, before)


def test_production_size_keeps_invariants() -> None:
    """DeepSeek-V3-like: 60 layers x 256 experts in 8 groups, 288 slots, 4 nodes x 8 ranks."""
    weight = skewed_load(60, 256, seed=6)
    placement = rebalance_experts(weight, 288, 8, 4, 32)
    phy2log, log2phy, logcnt = placement
    assert (logcnt >= 1).all() and (logcnt.sum(1) == 288).all()
    assert torch.equal(logcnt, torch.stack([row.bincount(minlength=256) for row in phy2log]))
    assert sorted(log2phy[log2phy >= 0].tolist()) == sorted(list(range(288)) * 60)
    gain = balancedness(weight, phy2log, logcnt, 32) - balancedness(
        weight, *identity_placement(60, 256), 32)
    assert (gain > 0).all()


# -- what the policy does -------------------------------------------------------------------


@pytest.mark.parametrize("config", HIERARCHICAL)
def test_hierarchical_keeps_groups_whole_on_one_node(config: tuple[int, int, int, int]) -> None:
    num_replicas, num_groups, num_nodes, num_ranks = config
    group_size = NUM_LOGICAL // num_groups
    slots_per_node = num_replicas // num_nodes
    weight = skewed_load(6, NUM_LOGICAL, seed=7)
    phy2log, _, _ = rebalance_experts(weight, *config)
    for layer in range(6):
        node_of_group: dict[int, int] = {}
        for node in range(num_nodes):
            experts = phy2log[layer, node * slots_per_node:(node + 1) * slots_per_node]
            groups = set((experts // group_size).tolist())
            assert len(groups) == num_groups // num_nodes, "equal number of groups per node"
            for group in groups:
                assert node_of_group.setdefault(group, node) == node, "group split over nodes"
                whole = set(range(group * group_size, (group + 1) * group_size))
                assert whole <= set(experts.tolist()), "every expert of the group on its node"
        assert len(node_of_group) == num_groups


def test_hierarchical_packs_heaviest_groups_apart() -> None:
    # Groups of 2 experts with loads 100, 90, 40, 10 onto 2 nodes: greedy puts the two
    # heaviest groups on different nodes, and the lightest with the heaviest.
    weight = torch.tensor([[50, 50, 45, 45, 20, 20, 5, 5]])
    phy2log, _, _ = rebalance_experts(weight, 8, 4, 2, 2)
    node0, node1 = set(phy2log[0, :4].tolist()), set(phy2log[0, 4:].tolist())
    assert node0 == {0, 1, 6, 7}
    assert node1 == {2, 3, 4, 5}


@pytest.mark.parametrize("config", [(24, 1, 1, 4), (24, 4, 2, 4)])
def test_hot_experts_get_more_replicas(config: tuple[int, int, int, int]) -> None:
    # Experts 5 and 6 share group 1, so under the hierarchical policy they sit on the
    # same node and compete for its spare slots with that node's cold experts (the
    # other node's cold experts share that node's spares among themselves).
    weight = torch.ones(1, NUM_LOGICAL)
    weight[0, 5] = 40.0
    weight[0, 6] = 20.0
    phy2log, log2phy, logcnt = rebalance_experts(weight, *config)
    slots_per_node = config[0] // config[2]
    nodes = phy2log[0].view(config[2], slots_per_node)
    node_of_5 = next(node for node in nodes if (node == 5).any())
    cold = [e for e in set(node_of_5.tolist()) if e not in (5, 6)]
    assert logcnt[0, 5] > logcnt[0, 6] > logcnt[0, cold].max()
    assert logcnt[0, 5] == logcnt.max()
    assert (log2phy[0, 5] >= 0).sum() == logcnt[0, 5]


@pytest.mark.parametrize("seed", range(4))
def test_replica_count_never_decreases_with_load(seed: int) -> None:
    # One group, one node: all experts compete for the same spare slots.
    weight = skewed_load(1, NUM_LOGICAL, seed=seed)[0] + torch.arange(NUM_LOGICAL)  # no ties
    _, _, logcnt = rebalance_experts(weight.unsqueeze(0), 40, 1, 1, 4)
    by_load = logcnt[0, weight.argsort(descending=True)]
    assert (by_load[:-1] >= by_load[1:]).all()
    assert by_load[0] > by_load[-1]


# The identity placement needs num_ranks to divide the 16 experts.
@pytest.mark.parametrize("config", HIERARCHICAL + GLOBAL[:2])
def test_rebalancing_beats_identity_on_skewed_load(config: tuple[int, int, int, int]) -> None:
    num_ranks = config[3]
    weight = skewed_load(8, NUM_LOGICAL, seed=11)
    phy2log, _, logcnt = rebalance_experts(weight, *config)
    balanced = balancedness(weight, phy2log, logcnt, num_ranks)
    identity = balancedness(weight, *identity_placement(8, NUM_LOGICAL), num_ranks)
    assert (balanced >= identity).all()
    assert balanced.mean() > identity.mean()


@pytest.mark.parametrize("config", [(16, 4, 2, 4), (24, 4, 2, 4), (32, 4, 2, 8), (24, 2, 4, 8),
                                    (16, 1, 1, 16)])
def test_uniform_load_is_perfectly_balanced(config: tuple[int, int, int, int]) -> None:
    weight = torch.full((2, NUM_LOGICAL), 7)
    phy2log, _, logcnt = rebalance_experts(weight, *config)
    assert torch.equal(balancedness(weight, phy2log, logcnt, config[3]),
                       torch.ones(2, dtype=torch.float64))


# -- exact outputs, worked by hand ----------------------------------------------------------


def test_module_docstring_example() -> None:
    phy2log, log2phy, logcnt = rebalance_experts(torch.tensor([[60, 20, 10, 10]]), 6, 1, 1, 2)
    assert phy2log.tolist() == [[0, 0, 2, 1, 0, 3]]
    assert logcnt.tolist() == [[3, 1, 1, 1]]
    assert log2phy.tolist() == [[[0, 1, 4], [3, -1, -1], [2, -1, -1], [5, -1, -1]]]


def test_hand_computed_hierarchical_case() -> None:
    # 8 experts in 4 groups of 2, 2 nodes, 4 ranks (2 per node), 12 slots (3 per rank).
    #
    # Step 1, groups -> nodes (2 groups each). Group loads: g0 = 90+10 = 100,
    # g1 = 20+20 = 40, g2 = 5+5 = 10, g3 = 60+30 = 90. Heaviest first onto the lighter
    # node with room: g0 -> node 0 (tie, lower node), g3 -> node 1 (0 < 100),
    # g1 -> node 1 (90 < 100), g2 -> node 0 (node 1 is full).
    # Node 0 holds experts [e0, e1, e4, e5] with loads [90, 10, 5, 5];
    # node 1 holds [e6, e7, e2, e3] with loads [60, 30, 20, 20].
    #
    # Step 2, 6 slots per node, so 2 spares each, to the highest load per replica.
    # Node 0: e0 (90) -> 2 copies at 45; e0 again (45 > 10) -> 3 copies at 30.
    #   slots [e0, e1, e4, e5, e0, e0], slot loads [30, 10, 5, 5, 30, 30]
    # Node 1: e6 (60) -> 2 copies at 30; now e6 and e7 tie at 30, the lower node-local
    #   index (e6 is first on this node) wins -> 3 copies at 20.
    #   slots [e6, e7, e2, e3, e6, e6], slot loads [20, 30, 20, 20, 20, 20]
    #
    # Step 3, each node's 6 slots onto its 2 ranks, 3 each, heaviest slot first (ties:
    # lower slot) onto the lighter rank with room (ties: lower rank).
    # Node 0 (ranks 0, 1): s0 -> r0 (30), s4 -> r1 (30), s5 -> r0 (60), s1 -> r1 (40),
    #   s2 -> r1 (45, full), s3 -> r0 (65). Rank 0 = [e0, e0, e5], rank 1 = [e0, e1, e4].
    # Node 1 (ranks 2, 3): s1 -> r2 (30), s0 -> r3 (20), s2 -> r3 (40), s3 -> r2 (50),
    #   s4 -> r3 (60, full), s5 -> r2 (70). Rank 2 = [e7, e3, e6], rank 3 = [e6, e2, e6].
    #
    # Rank loads 65, 45, 70, 60: balancedness = mean 60 / max 70 = 6/7. Without
    # redundancy (expert i on slot i, 2 per rank) the ranks serve 100, 40, 10, 90: 60/100.
    weight = torch.tensor([[90, 10, 20, 20, 5, 5, 60, 30]])
    phy2log, log2phy, logcnt = rebalance_experts(weight, 12, 4, 2, 4)
    assert phy2log.tolist() == [[0, 0, 5, 0, 1, 4, 7, 3, 6, 6, 2, 6]]
    assert logcnt.tolist() == [[3, 1, 1, 1, 1, 1, 3, 1]]
    width = 12 - 8 + 1
    slots = [[0, 1, 3], [4], [10], [7], [5], [2], [8, 9, 11], [6]]
    assert log2phy.tolist() == [[row + [-1] * (width - len(row)) for row in slots]]
    assert balancedness(weight, phy2log, logcnt, 4).item() == pytest.approx(6 / 7)
    identity = balancedness(weight, *identity_placement(1, 8), 4)
    assert identity.item() == pytest.approx(0.6)


# -- the global policy ----------------------------------------------------------------------


@pytest.mark.parametrize("config", GLOBAL)
def test_global_policy_is_one_node_one_group(config: tuple[int, int, int, int]) -> None:
    num_replicas, num_groups, num_nodes, num_ranks = config
    assert num_groups % num_nodes != 0
    weight = skewed_load(4, NUM_LOGICAL, seed=13)
    chosen = rebalance_experts(weight, *config)
    flat = rebalance_experts(weight, num_replicas, 1, 1, num_ranks)
    for a, b in zip(chosen, flat, strict=True):
        assert torch.equal(a, b)


def test_global_policy_spreads_a_hot_expert_over_nodes() -> None:
    # 3 groups cannot be split evenly over 2 nodes, so the policy is global and the hot
    # expert's replicas land on both nodes (hierarchical would keep them on one).
    weight = torch.tensor([[1000, 1, 1, 1, 1, 1]])
    phy2log, log2phy, logcnt = rebalance_experts(weight, 8, 3, 2, 2)
    assert logcnt[0, 0] == 3
    hot_slots = log2phy[0, 0, :3]
    assert set((hot_slots // 4).tolist()) == {0, 1}  # 4 slots per rank, 1 rank per node


# -- balancedness ---------------------------------------------------------------------------


def test_balancedness_splits_load_over_replicas() -> None:
    # Expert 0 (load 8) has two replicas, one per rank: ranks serve 4 + 2 and 4 + 0.
    weight = torch.tensor([[8.0, 2.0, 0.0]])
    phy2log = torch.tensor([[0, 1, 0, 2]])
    logcnt = torch.tensor([[2, 1, 1]])
    assert balancedness(weight, phy2log, logcnt, 2).item() == pytest.approx(5 / 6)


def test_balancedness_of_an_idle_layer_is_one() -> None:
    phy2log, logcnt = identity_placement(1, 4)
    assert balancedness(torch.zeros(1, 4), phy2log, logcnt, 2).item() == 1.0


@pytest.mark.parametrize(("phy2log", "logcnt", "num_ranks", "names"), [
    (torch.tensor([0, 1, 2, 3]), torch.ones(1, 4), 2, "phy2log"),
    (torch.tensor([[0, 1, 2, 3]]), torch.ones(1, 3), 2, "logcnt"),
    (torch.tensor([[0, 1, 2, 3]]), torch.ones(1, 4), 3, "num_replicas.*num_ranks"),
])
def test_balancedness_rejects_mismatched_shapes(phy2log: torch.Tensor, logcnt: torch.Tensor,
                                               num_ranks: int, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        balancedness(torch.ones(1, 4), phy2log, logcnt, num_ranks)


# -- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(("weight", "config", "message"), [
    (torch.ones(16), (16, 4, 2, 4), r"weight must be 2-D.*\[16\]"),
    (torch.ones(2, 2, 16), (16, 4, 2, 4), r"weight must be 2-D"),
    (torch.ones(0, 16), (16, 4, 2, 4), r"weight.*at least one layer"),
    (torch.ones(2, 16), (18, 4, 2, 4), r"num_replicas \(18\).*num_ranks \(4\)"),
    (torch.ones(2, 16), (24, 4, 4, 6), r"num_ranks \(6\).*num_nodes \(4\)"),
    (torch.ones(2, 15), (24, 4, 2, 4), r"num_logical_experts \(15.*num_groups \(4\)"),
    (torch.ones(2, 16), (12, 4, 2, 4), r"num_replicas \(12\).*num_logical_experts \(16"),
    (torch.ones(2, 16), (0, 4, 2, 4), r"num_replicas must be positive, got 0"),
    (torch.ones(2, 16), (16, 0, 2, 4), r"num_groups must be positive, got 0"),
    (torch.ones(2, 16), (16, 4, -2, 4), r"num_nodes must be positive, got -2"),
    (torch.ones(2, 16), (16, 4, 2, 0), r"num_ranks must be positive, got 0"),
    (torch.ones(2, 16).index_fill(1, torch.tensor([3]), -1.0), (16, 4, 2, 4),
     r"weight must be non-negative.*\(0, 3\)"),
    (torch.ones(2, 16).index_fill(1, torch.tensor([7]), float("nan")), (16, 4, 2, 4),
     r"weight must be finite.*NaN.*\(0, 7\)"),
    (torch.ones(2, 16).index_fill(1, torch.tensor([7]), float("inf")), (16, 4, 2, 4),
     r"weight must be finite"),
])
def test_invalid_arguments_are_named(weight: torch.Tensor, config: tuple[int, int, int, int],
                                     message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rebalance_experts(weight, *config)


def test_non_integer_counts_are_rejected() -> None:
    with pytest.raises(TypeError):
        rebalance_experts(torch.ones(1, 16), 16.0, 4, 2, 4)  # type: ignore[arg-type]


@pytest.mark.parametrize("load", [zipf_load, random_load, skewed_load])
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("config", HIERARCHICAL + GLOBAL[:2])
def test_never_worse_than_identity(load, seed: int, config: tuple[int, int, int, int]) -> None:
    """On random and Zipf-skewed loads: every expert keeps a replica, every rank the same
    number of slots, the maps agree, and no layer ends less balanced than with expert i
    on slot i."""
    weight = load(6, NUM_LOGICAL, seed)
    placement = rebalance_experts(weight, *config)
    assert_consistent(placement, NUM_LOGICAL, config[0], config[3])
    phy2log, _, logcnt = placement
    balanced = balancedness(weight, phy2log, logcnt, config[3])
    identity = balancedness(weight, *identity_placement(6, NUM_LOGICAL), config[3])
    assert (balanced >= identity - 1e-12).all(), (balanced, identity)
