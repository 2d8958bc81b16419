"""Expert-parallel load balancing (EPLB): where each MoE expert's replicas should live.

Given how many tokens each logical expert received in each MoE layer, choose
``num_replicas`` physical expert slots per layer (some experts hold several copies of
themselves), and lay those slots out over ``num_ranks`` ranks so that every rank
serves about the same number of tokens. This follows DeepSeek's published EPLB
(github.com/deepseek-ai/EPLB, ``eplb.py``; vLLM's ``rebalance_algo.py`` is the same).

Hierarchical policy (``num_groups % num_nodes == 0``), per layer:

    1. groups -> nodes   pack the expert groups onto the nodes, the same number of
                         groups per node: heaviest group first, each onto the
                         least-loaded node that still has room. A group never straddles
                         nodes, so group-limited routing stays inside a node.
    2. replicate         within each node, start with one slot per expert, then give
                         each of the node's spare slots, one at a time, to the expert
                         whose load per replica is highest.
    3. slots -> ranks    pack the node's slots onto the node's ranks, the same number of
                         slots per rank, by the same rule as step 1; each slot weighs
                         its expert's load divided by the expert's replica count.

Global policy (otherwise): the same three steps with one node and one group, so
replicas are made across the whole layer and packed straight onto the ranks.

Ties are broken by index (the lower group, expert, node or rank wins), so the result
is a pure function of its arguments.

Slot ``s`` lives on rank ``s // (num_replicas // num_ranks)``; rank ``r`` lives on
node ``r // (num_ranks // num_nodes)``. Within a rank, slots are in the order the
packing chose them (heaviest first)::

    rank:        0             1         ...    num_ranks - 1
    slot:  [0 .. P-1]  [P .. 2P-1]       ...    [.. num_replicas-1]     P = slots per rank

Worked example: one layer, 4 experts with loads [60, 20, 10, 10], 6 slots, 2 ranks
(3 slots each), one node, one group.

    replicate   slots start as experts [0, 1, 2, 3]; spare slot 1 goes to expert 0
                (60/1 is the highest), spare slot 2 to expert 0 again (60/2 = 30 > 20):
                slots [0, 1, 2, 3, 0, 0], each slot's load [20, 20, 10, 10, 20, 20]
    pack        heaviest first, ties to the lower slot and the lower rank:
                slot 0 -> rank 0, slot 1 -> rank 1, slot 4 -> rank 0, slot 5 -> rank 1,
                slot 2 -> rank 0, slot 3 -> rank 1; both ranks serve 50 tokens
    result      phy2log = [[0, 0, 2, 1, 0, 3]]
                logcnt  = [[3, 1, 1, 1]]
                log2phy = [[[0, 1, 4], [3, -1, -1], [2, -1, -1], [5, -1, -1]]]

Shapes (L = num_layers, E = num_logical_experts, R = num_replicas):

    weight   [L, E]          tokens routed to each logical expert (any real dtype/device)
    phy2log  [L, R]          int64, logical expert held by each physical slot
    log2phy  [L, E, R-E+1]   int64, physical slots of each expert, ascending, -1 padded
    logcnt   [L, E]          int64, replica count of each expert (>= 1, sums to R)

``log2phy``'s last dimension is ``R - E + 1``, the most replicas any expert can get
(every other expert keeps one), as vLLM does; DeepSeek's own code uses the largest
count that actually occurs. The fixed width depends only on the configuration, so
a consumer can preallocate the table once and copy every new placement into it.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

__all__ = ["ExpertPlacement", "balancedness", "rebalance_experts"]


class ExpertPlacement(NamedTuple):
    """Where every expert replica lives; unpacks as ``phy2log, log2phy, logcnt``.

    Invariants, per layer: ``logcnt`` sums to ``num_replicas`` and is >= 1 everywhere;
    expert ``e`` appears in ``phy2log`` exactly ``logcnt[e]`` times, at the slots listed
    in ``log2phy[e, :logcnt[e]]`` (ascending); the rest of ``log2phy[e]`` is -1.
    All three tensors are int64 on the CPU.
    """

    phy2log: torch.Tensor  # [num_layers, num_replicas]
    log2phy: torch.Tensor  # [num_layers, num_logical_experts, num_replicas - num_logical + 1]
    logcnt: torch.Tensor  # [num_layers, num_logical_experts]


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int,
                      num_nodes: int, num_ranks: int) -> ExpertPlacement:
    """Place ``num_replicas`` physical experts per layer over ``num_ranks`` ranks.

    weight: [num_layers, num_logical_experts] load statistics, non-negative.
    num_replicas: physical slots per layer, a multiple of ``num_ranks`` and at least
        the number of logical experts.
    num_groups: expert groups of the model (the logical experts divide evenly into them).
    num_nodes: nodes, whose intra-node links are faster; ``num_ranks`` divides evenly.
    num_ranks: ranks (devices) in the expert-parallel group.

    Raises ValueError naming the argument when a shape, count or weight is invalid.
    """
    num_replicas, num_groups, num_nodes, num_ranks = (
        operator.index(n) for n in (num_replicas, num_groups, num_nodes, num_ranks))
    load = _checked_load(weight)
    _check_counts(load.shape[1], num_replicas, num_groups, num_nodes, num_ranks)
    if num_groups % num_nodes == 0:
        phy2log, logcnt = _place_hierarchical(load, num_replicas, num_groups, num_nodes,
                                              num_ranks)
    else:
        phy2log, logcnt = _place_hierarchical(load, num_replicas, 1, 1, num_ranks)
    return ExpertPlacement(phy2log, _slots_of_each_expert(phy2log, logcnt), logcnt)


def balancedness(weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor,
                 num_ranks: int) -> torch.Tensor:
    """Per layer, mean over max of the tokens each rank serves; 1.0 is perfectly even.

    Each logical expert's load is split evenly across its replicas. A layer with no
    load at all counts as balanced. Returns float64 [num_layers] on the CPU.
    """
    num_ranks = operator.index(num_ranks)
    load = _checked_load(weight)  # [L, E]
    phy2log = phy2log.to("cpu", torch.int64)
    logcnt = logcnt.to("cpu", torch.int64)
    if phy2log.dim() != 2 or phy2log.shape[0] != load.shape[0]:
        raise ValueError(f"phy2log must be [num_layers={load.shape[0]}, num_replicas], "
                         f"got {list(phy2log.shape)}")
    if logcnt.shape != load.shape:
        raise ValueError(f"logcnt must have weight's shape {list(load.shape)}, "
                         f"got {list(logcnt.shape)}")
    num_layers, num_replicas = phy2log.shape
    if num_ranks <= 0 or num_replicas % num_ranks != 0:
        raise ValueError(f"num_replicas ({num_replicas}, from phy2log) must be a multiple "
                         f"of num_ranks ({num_ranks})")
    slot_load = (load / logcnt).gather(1, phy2log)  # [L, R]
    rank_load = slot_load.view(num_layers, num_ranks, -1).sum(-1)  # [L, num_ranks]
    peak = rank_load.max(-1).values  # [L]
    ratio = rank_load.mean(-1) / peak.clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where(peak > 0, ratio, torch.ones_like(ratio))


def _checked_load(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as float64 on the CPU, after checking its shape and values.

    float64 because token counts are integers: float32 stops counting exactly at 2**24
    (16.7M tokens), which a group's load over a long window easily passes.
    """
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError("weight must be 2-D [num_layers, num_logical_experts], "
                         f"got shape {list(weight.shape)}")
    if weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(f"weight must have at least one layer and one expert, "
                         f"got shape {list(weight.shape)}")
    if weight.is_complex():
        raise ValueError(f"weight must be real, got dtype {weight.dtype}")
    load = weight.detach().to("cpu", torch.float64)
    if not torch.isfinite(load).all():
        raise ValueError("weight must be finite, found NaN or infinity at "
                         f"(layer, expert) {_first(~torch.isfinite(load))}")
    if (load < 0).any():
        raise ValueError(f"weight must be non-negative, found a negative load at "
                         f"(layer, expert) {_first(load < 0)}")
    return load


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def _check_counts(num_logical: int, num_replicas: int, num_groups: int, num_nodes: int,
                  num_ranks: int) -> None:
    for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups),
                        ("num_nodes", num_nodes), ("num_ranks", num_ranks)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if num_replicas % num_ranks != 0:
        raise ValueError(f"num_replicas ({num_replicas}) must be a multiple of "
                         f"num_ranks ({num_ranks})")
    if num_ranks % num_nodes != 0:
        raise ValueError(f"num_ranks ({num_ranks}) must be a multiple of "
                         f"num_nodes ({num_nodes})")
    if num_logical % num_groups != 0:
        raise ValueError(f"num_logical_experts ({num_logical}, weight.shape[1]) must be "
                         f"a multiple of num_groups ({num_groups})")
    if num_replicas < num_logical:
        raise ValueError(f"num_replicas ({num_replicas}) must be at least "
                         f"num_logical_experts ({num_logical}, weight.shape[1])")


def _place_hierarchical(load: torch.Tensor, num_replicas: int, num_groups: int,
                        num_nodes: int, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-3 of the module docstring; returns (phy2log [L, R], logcnt [L, E]).

    Steps 2 and 3 run on every (layer, node) pair at once, as rows of one tensor. They
    see a node's experts in "node-major" order: node 0's experts first, in the order
    its groups were packed onto it (experts within a group keep their order), then
    node 1's, and so on.
    """
    num_layers, num_logical = load.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_logical // num_nodes
    slots_per_node = num_replicas // num_nodes
    ranks_per_node = num_ranks // num_nodes
    slots_per_rank = num_replicas // num_ranks

    # 1. groups -> nodes
    group_load = load.view(num_layers, num_groups, group_size).sum(-1)  # [L, G]
    group_node, position_in_node = _pack_evenly(group_load, num_nodes)  # [L, G] each
    group_rank = group_node * groups_per_node + position_in_node  # [L, G], node-major
    log2nm = (group_rank.unsqueeze(-1) * group_size
              + torch.arange(group_size)).flatten(1)  # [L, E]: expert -> node-major index
    nm2log = _inverse(log2nm)  # [L, E]
    node_load = load.gather(1, nm2log).view(-1, experts_per_node)  # [L * N, E / N]

    # 2. replicate within each node
    slot_expert, node_count = _replicate(node_load, slots_per_node)  # [L*N, R/N], [L*N, E/N]

    # 3. slots -> ranks within each node
    slot_load = (node_load / node_count).gather(1, slot_expert)  # [L * N, R / N]
    slot_rank, position_in_rank = _pack_evenly(slot_load, ranks_per_node)
    placed = _scatter_to(slot_expert, slot_rank * slots_per_rank + position_in_rank)

    # back from node-local, node-major indices to logical expert ids
    node_offset = torch.arange(num_nodes).view(1, num_nodes, 1) * experts_per_node
    placed_nm = (placed.view(num_layers, num_nodes, slots_per_node) + node_offset).flatten(1)
    phy2log = nm2log.gather(1, placed_nm)  # [L, R]
    logcnt = node_count.view(num_layers, num_logical).gather(1, log2nm)  # [L, E]
    return phy2log, logcnt


def _pack_evenly(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack each row's n items into ``num_packs`` packs of exactly n / num_packs items.

    Greedy, heaviest item first (ties: lower item index), each onto the lightest pack
    that still has room (ties: lower pack index). When every pack holds one item,
    item i simply goes to pack i.

    weight: [X, n]. Returns (pack [X, n], position [X, n]): the pack of each item and
    the order in which it went into that pack (0 for the first).
    """
    rows, num_items = weight.shape
    capacity = num_items // num_packs
    if capacity == 1:
        identity = torch.arange(num_items).expand(rows, num_items).clone()
        return identity, torch.zeros_like(identity)
    row = torch.arange(rows)
    pack_load = torch.zeros(rows, num_packs, dtype=weight.dtype)
    pack_fill = torch.zeros(rows, num_packs, dtype=torch.int64)
    pack = torch.empty(rows, num_items, dtype=torch.int64)
    position = torch.empty(rows, num_items, dtype=torch.int64)
    heaviest_first = weight.argsort(dim=1, descending=True, stable=True)  # [X, n]
    for item in heaviest_first.unbind(1):  # [X]: each row's next-heaviest item
        open_load = pack_load.masked_fill(pack_fill == capacity, float("inf"))
        target = open_load.argmin(1)  # [X]; argmin returns the first of equal minima
        pack[row, item] = target
        position[row, item] = pack_fill[row, target]
        pack_load[row, target] += weight[row, item]
        pack_fill[row, target] += 1
    return pack, position


def _replicate(weight: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Give each of n items one slot, then each spare slot to the item with the highest
    weight per slot (ties: lower index). This minimises the heaviest slot.

    weight: [X, n]. Returns (slot_item [X, num_slots], count [X, n]); slot i < n holds
    item i, and spare slots follow in the order they were handed out.
    """
    rows, num_items = weight.shape
    row = torch.arange(rows)
    count = torch.ones(rows, num_items, dtype=torch.int64)
    slot_item = [torch.arange(num_items).expand(rows, num_items)]
    for _ in range(num_slots - num_items):
        hottest = (weight / count).argmax(1)  # [X]; argmax returns the first of equal maxima
        slot_item.append(hottest.unsqueeze(1))
        count[row, hottest] += 1
    return torch.cat(slot_item, dim=1), count


def _slots_of_each_expert(phy2log: torch.Tensor, logcnt: torch.Tensor) -> torch.Tensor:
    """log2phy [L, E, R - E + 1]: each expert's slots ascending, padded with -1."""
    num_layers, num_replicas = phy2log.shape
    num_logical = logcnt.shape[1]
    width = num_replicas - num_logical + 1
    slot_by_expert = phy2log.argsort(dim=1, stable=True)  # [L, R]: grouped by expert
    expert = phy2log.gather(1, slot_by_expert)  # [L, R], non-decreasing
    first = (logcnt.cumsum(1) - logcnt).gather(1, expert)  # [L, R]: start of expert's run
    replica = torch.arange(num_replicas) - first  # [L, R]: index within that run
    log2phy = torch.full((num_layers, num_logical * width), -1, dtype=torch.int64)
    log2phy.scatter_(1, expert * width + replica, slot_by_expert)
    return log2phy.view(num_layers, num_logical, width)


def _scatter_to(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """out[x, index[x, i]] = values[x, i], where each row of ``index`` is a permutation."""
    return torch.empty_like(values).scatter_(1, index, values)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of each row's permutation: out[x, perm[x, i]] = i."""
    return _scatter_to(torch.arange(perm.shape[1]).expand_as(perm), perm)
