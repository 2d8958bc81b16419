"""vLLM-Ascend's EPLB policies beside DeepSeek's (``rebalance.py``), which take the
placement the ranks run and move few experts: ``eplb_config.eplb_policy_type``

    0  the test policy: in every layer, the last slots of ranks 3 and 1 trade experts
    2  SwiftBalance (vLLM-Ascend's default): per layer, when the hottest rank carries
       1% more than the mean, re-choose the redundant replicas and swap experts between
       the hottest rank and the others; keep the layer's new placement only if its
       hottest rank got cooler

as vllm_ascend/eplb/core/policy/policy_random.py and policy_swift_balancer.py decide
(182b75ea). SwiftBalance, per layer (the whole layer one node: vLLM-Ascend's worker never
asks for node-local redundancy):

    1. the first copy of each expert (slot by slot, rank by rank) stays; the later
       copies' slots are its redundant slots
    2. those slots go, one at a time, to the expert with the most load per replica
       (each new replica scales the expert's weight by (c + 1) / (c + 2), c its
       replicas so far, as vLLM-Ascend does), placed on the least-loaded rank with a
       free redundant slot that lacks the expert and has not yet received one from the
       expert's rank; slots left over take the heaviest experts they lack
    3. up to 100 times: the hottest rank trades one expert with the first rank (coolest
       first) where a trade lowers the pair's larger load by at least 1% of layer 0's
       mean rank load, each pair of ranks trading once, an expert received this round
       never traded again
    4. a rank's experts come out in the order of a Python set of their ids (vLLM-Ascend
       lists its sets), then every expert the rank kept goes back to its old slot and
       the new ones fill the rest in that order: the fewest weights move

Step 2's weights (2/3 of an expert's load for its second replica, then 3/4 of that...)
and the layer's judge (its estimate of the hottest rank against *layer 0's* mean rank
load) are vLLM-Ascend's, quirks included, so a layer may come out hotter by the true
measure; the EPLB controller publishes a placement only when it balances better. Loads
and per-rank sums are float32 where vLLM-Ascend keeps them so (its numpy arrays), so ties
fall the same way. Input and output are ``phy2log`` [layers, slots], slot ``s``
on rank ``s // (slots / ranks)``.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

IMBALANCE_THRESHOLD = 1.01  # a layer whose hottest rank is below this x the mean stays
SWAP_GAIN = 0.01  # a trade must cool the pair by this share of the mean rank load
MAX_SWAPS = 100
MAX_TRANSFERS = 1  # weights one rank sends another per layer


def swap_test(phy2log: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Policy 0: the last slots of ranks 3 and 1 trade experts in every layer (vLLM-
    Ascend's fixed pair). ValueError with fewer than 4 ranks."""
    if num_ranks < 4:
        raise ValueError(f"eplb_config.eplb_policy_type: 0 swaps the last experts of ranks "
                         f"3 and 1, and there are {num_ranks} ranks")
    table = phy2log.clone().view(phy2log.shape[0], num_ranks, -1)
    table[:, [3, 1], -1] = table[:, [1, 3], -1].clone()
    return table.reshape(phy2log.shape)


def swift_balance(phy2log: torch.Tensor, load: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Policy 2 (see the module docstring): the new ``phy2log`` for the logical
    experts' ``load`` [layers, experts] under the current ``phy2log``."""
    table = phy2log.view(phy2log.shape[0], num_ranks, -1).numpy()
    weights = load.double().numpy()
    mean = weights[0].sum() / num_ranks  # (vLLM-Ascend measures every layer by layer 0's)
    out = table.copy()
    for layer in range(table.shape[0]):
        before = _imbalance(table[layer], weights[layer], num_ranks)
        if before < IMBALANCE_THRESHOLD or mean == 0:
            continue
        ranks, hottest = _rebalance_layer(table[layer], weights[layer], mean * SWAP_GAIN)
        if hottest / mean < before:
            out[layer] = _keep_slots(table[layer], ranks)
    return torch.from_numpy(out).reshape(phy2log.shape).to(torch.int64)


def _imbalance(layer: np.ndarray, weights: np.ndarray, num_ranks: int) -> float:
    """The hottest rank's load over the mean rank load, each replica carrying an equal
    share of its expert (1.0 for a layer without load)."""
    copies = np.bincount(layer.ravel(), minlength=len(weights))
    rank_loads = [sum(weights[e] / copies[e] for e in rank) for rank in layer]
    mean = sum(rank_loads) / num_ranks
    return 1.0 if abs(mean) < 1e-9 else max(rank_loads) / mean


class _Layer:
    """One layer while SwiftBalance re-places it."""

    def __init__(self, layer: np.ndarray, weights: np.ndarray):
        self.num_ranks, self.per_rank = layer.shape
        self.weights = weights
        # step 1: first copies stay (slot by slot across the ranks), later ones free up
        self.home = np.zeros(len(weights), dtype=np.int64)  # the rank of the first copy
        self.free: list[list[int]] = [[] for _ in range(self.num_ranks)]
        seen: set[int] = set()
        for slot in range(self.per_rank):
            for rank in range(self.num_ranks):
                expert = int(layer[rank][slot])
                if expert in seen:
                    self.free[rank].append(slot)
                else:
                    seen.add(expert)
                    self.home[expert] = rank
        self.present = sorted(seen)
        self.ranks = np.full(layer.shape, -1, dtype=np.int64)
        self.sent = np.zeros((self.num_ranks, self.num_ranks), dtype=np.int64)
        self.received: defaultdict[int, set[int]] = defaultdict(set)

    def replicate(self) -> tuple[list[tuple[int, float]], np.ndarray]:
        """Step 2's choice of replicas: (expert, its weight per replica) heaviest first,
        and every expert's weight per replica (float32)."""
        current = [(e, self.weights[e]) for e in self.present]
        extra = np.zeros(len(self.weights), dtype=np.int64)
        for _ in range(sum(len(f) for f in self.free)):
            order = np.argsort([w for _, w in current], kind="stable")[::-1]
            for i in order:
                expert, weight = current[i]
                copies = extra[expert] + 1
                if copies < self.num_ranks:
                    extra[expert] += 1
                    current[i] = (expert, weight * (copies + 1) / (copies + 2))
                    break
        per_replica = np.zeros(len(self.weights), dtype=np.float32)
        for expert, weight in current:
            per_replica[expert] = weight
        replicas = sorted(((e, float(per_replica[e])) for e in range(len(self.weights))
                           for _ in range(extra[e])), key=lambda r: r[1], reverse=True)
        return replicas, per_replica

    def place(self, layer: np.ndarray, replicas: list[tuple[int, float]],
              per_replica: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Step 2's placement; (rank loads, the weights per replica after it)."""
        loads = np.zeros(self.num_ranks, dtype=np.float32)
        for rank in range(self.num_ranks):
            for slot, expert in enumerate(layer[rank]):
                if slot not in self.free[rank]:
                    self.ranks[rank][slot] = expert
                    loads[rank] += per_replica[expert]
        for expert, weight in replicas:
            target = -1
            for rank in range(self.num_ranks):
                if not self.free[rank] or expert in self.ranks[rank] \
                        or self.sent[self.home[expert]][rank] >= MAX_TRANSFERS:
                    continue
                if target == -1 or loads[rank] < loads[target]:
                    target = rank
            if target != -1:
                self._receive(target, self.free[target].pop(), expert)
                loads[target] += weight
        if not any(self.free):
            return loads, per_replica
        return self._fill_left_over()

    def _receive(self, rank: int, slot: int, expert: int) -> None:
        self.ranks[rank][slot] = expert
        self.sent[self.home[expert]][rank] += 1
        self.received[rank].add(expert)

    def _fill_left_over(self) -> tuple[np.ndarray, np.ndarray]:
        """Free slots nobody took: each takes the heaviest expert (per replica) its rank
        lacks, the rank loads then summed again."""
        copies = np.zeros(len(self.weights), dtype=np.int64)
        for expert in self.ranks.ravel():
            if expert != -1:
                copies[expert] += 1
        per_replica = np.full(len(self.weights), -1, dtype=np.float32)
        for expert in self.present:
            per_replica[expert] = self.weights[expert] / copies[expert]
        for rank in range(self.num_ranks):
            for slot in self.free[rank]:
                for expert in np.argsort(per_replica, kind="stable")[::-1]:
                    if expert in self.ranks[rank]:
                        continue
                    if np.isclose(per_replica[expert], -1):
                        raise ValueError(f"expert {expert} is in no slot of the layer")
                    self._receive(rank, slot, int(expert))
                    per_replica[expert] *= copies[expert] / (copies[expert] + 1)
                    copies[expert] += 1
                    break
        loads = np.zeros(self.num_ranks, dtype=np.float32)
        for rank in range(self.num_ranks):
            for expert in self.ranks[rank]:
                loads[rank] += per_replica[expert]
        return loads, per_replica

    def trade(self, loads: np.ndarray, per_replica: np.ndarray, gain: float
              ) -> tuple[list[list[int]], float]:
        """Step 3; (each rank's experts, in its set's order; the hottest rank's load)."""
        held = [set(int(e) for e in rank) for rank in self.ranks]
        hottest_load, traded = 0.0, True
        for _ in range(MAX_SWAPS):
            order = np.argsort(loads, kind="stable")
            hottest = int(order[-1])
            hottest_load = float(loads[hottest])
            if not traded:
                break
            traded = False
            for other in order[:-1]:
                if self.sent[other][hottest] >= MAX_TRANSFERS \
                        or self.sent[hottest][other] >= MAX_TRANSFERS:
                    continue
                give, take, after = self._best_trade(held, hottest, int(other), per_replica,
                                                     hottest_load, loads[other])
                if give == -1 or hottest_load - after < gain:
                    continue
                # (in vLLM-Ascend's order: the sets' iteration order depends on it)
                held[hottest].remove(give)
                held[other].remove(take)
                held[hottest].add(take)
                held[other].add(give)
                loads[hottest] += per_replica[take] - per_replica[give]
                loads[other] += per_replica[give] - per_replica[take]
                self.received[hottest].add(take)
                self.received[other].add(give)
                self.sent[other][hottest] += 1
                self.sent[hottest][other] += 1
                traded = True
                break
        return [list(s) for s in held], hottest_load

    def _best_trade(self, held: list[set[int]], hot: int, other: int, per_replica: np.ndarray,
                    hot_load: float, other_load: float) -> tuple[int, int, float]:
        """(the hot rank's expert to give, the other's to take, the pair's larger load
        after) that lowers it most; -1, -1 and ``hot_load`` if none does."""
        best = (-1, -1, hot_load)
        for give in held[hot]:
            if give in held[other] or give in self.received[hot]:
                continue
            give_w = float(per_replica[give])
            for take in held[other]:
                if take in held[hot] or take in self.received[other]:
                    continue
                take_w = float(per_replica[take])
                after = max(hot_load - give_w + take_w, other_load - take_w + give_w)
                if after < best[2]:
                    best = (give, take, after)
        return best


def _rebalance_layer(layer: np.ndarray, weights: np.ndarray, gain: float
                     ) -> tuple[list[list[int]], float]:
    state = _Layer(layer, weights)
    replicas, per_replica = state.replicate()
    loads, per_replica = state.place(layer, replicas, per_replica)
    return state.trade(loads, per_replica, gain)


def _keep_slots(old: np.ndarray, new: list[list[int]]) -> np.ndarray:
    """Step 4: each rank's kept experts back in their old slots, the new ones in the
    free slots in order."""
    out = np.empty_like(old)
    for rank, (was, now) in enumerate(zip(old.tolist(), new, strict=True)):
        row = [-1] * len(was)
        claimed = [False] * len(was)
        arriving = []
        for expert in now:
            at = next((j for j, e in enumerate(was) if e == expert and not claimed[j]), None)
            if at is None:
                arriving.append(expert)
            else:
                claimed[at] = True
                row[at] = expert
        it = iter(arriving)
        out[rank] = [e if e != -1 else next(it) for e in row]
    return out
