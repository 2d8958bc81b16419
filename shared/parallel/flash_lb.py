"""FlashLB, vLLM-Ascend's ``eplb_policy_type`` 3: replicas and placement chosen together
from a time series of expert load, so that experts that run hot *at the same time* land
on different ranks, as vllm_ascend/eplb/core/policy/policy_flashlb.py decides (182b75ea).

Per layer, from ``hotness`` [stages, experts] (tokens per stage, plus one per step):

    1. mean, variance and covariance of each expert's load over the stages; an expert's
       weight is mean + z * std, z the 75th percentile of the normal law (0.674...)
    2. a tree search of ``depth`` levels over the experts, heaviest first: each level
       splits the replicas still free between the next quarter of the experts and the
       rest, trying the min-max share and up to ``width`` more or fewer on either side,
       each split judged by placing every replica and scoring that placement on the
       stages (mean over stages of hottest rank * ranks / total)
    3. a placement (largest processing time first): replicas by load per replica, each
       to the rank whose load mean + z * std (the covariances of what the rank holds
       counted) grows least, never two copies of an expert on a rank
    4. the ranks of the new placement are matched to the old ones (an assignment that
       keeps the most experts in place: a shortest-augmenting-path solver, as scipy's
       linear_sum_assignment, ties falling as there) and each rank's kept experts stay
       in their slots

A layer is re-placed only when its average-to-peak ratio (1 / score) fell below 0.9 of
the ratio it reached when last placed or below 0.85 (0.95 and 0.9 with fewer than 32
ranks), or at the first call. Every layer's new placement is returned, as vLLM-Ascend's
worker applies them; the layers that improve come first in ``improved``.

The arithmetic follows vLLM-Ascend's, float32 where it stores float32, so placements
match its code run by numpy; its numba build (fastmath) may round and order ties among
equally loaded experts differently. vLLM-Ascend scores the current placement on the
unbinned steps; here the ranks send the series already cut into at most 64 stages (the
sample FlashLB itself searches on), and that is what every score sees.
"""

from __future__ import annotations

import math

import numpy as np

Z_SCORE = 0.6744897501960817  # the normal law's 75th percentile (scipy.stats.norm.ppf)
DEPTH = 4
WIDTH = 8
SAMPLE_SIZE = 64  # stages the search scores on


def min_max_replicas(mu: np.ndarray, var: np.ndarray, extra: int,
                     z: float = Z_SCORE) -> np.ndarray:
    """[extra + 1, N] int32: the replica counts after 0, 1, ... ``extra`` more replicas,
    each going to the expert with the most load per replica (first such expert)."""
    if mu.shape[0] == 0:
        return np.ones((extra + 1, 0), dtype=np.int32)
    weight = mu + z * np.sqrt(var)
    replicas = np.ones(mu.shape[0], dtype=np.int32)
    per_replica = weight / replicas
    history = np.ones((extra + 1, mu.shape[0]), dtype=np.int32)
    for r in range(extra):
        i = int(np.argmax(per_replica))
        replicas[i] += 1
        per_replica[i] = weight[i] / replicas[i]
        history[r + 1] = replicas
    return history


def lpt_place(mu: np.ndarray, var: np.ndarray, cov: np.ndarray, replicas: np.ndarray,
              num_ranks: int, per_rank: int, z: float = Z_SCORE) -> np.ndarray:
    """[ranks, per_rank] int32 expert table; -1 where a replica found no rank (more
    replicas of an expert than ranks)."""
    table = np.full((num_ranks, per_rank), -1, dtype=np.int32)
    rank_mu = np.zeros(num_ranks, dtype=np.float32)
    rank_var = np.zeros(num_ranks, dtype=np.float32)
    filled = np.zeros(num_ranks, dtype=np.int64)
    holds = np.zeros((num_ranks, mu.shape[0]), dtype=bool)
    for expert in np.argsort(-(mu / replicas)):
        r = int(replicas[expert])
        for _ in range(r):
            open_ = (filled < per_rank) & ~holds[:, expert]
            if not open_.any():
                break
            new_mu = rank_mu.astype(np.float64) + mu[expert] / r
            new_var = rank_var.astype(np.float64) + var[expert] / r ** 2
            for k in range(per_rank):  # the covariances, slot by slot, as summed there
                held = table[:, k]
                has = held >= 0
                if not has.any():
                    break
                other = np.where(has, held, 0)
                term = 2 * cov[expert, other] / r / replicas[other]
                new_var = np.where(has, new_var + term, new_var)
            with np.errstate(invalid="ignore"):
                risk = new_mu + z * np.sqrt(new_var)
            risk = np.where(open_ & ~np.isnan(risk), risk, np.inf)
            if not (risk < 1e30).any():  # (vLLM-Ascend's starting best risk)
                break
            best = int(np.argmin(risk))
            rank_mu[best] = new_mu[best]
            rank_var[best] = new_var[best]
            table[best, filled[best]] = expert
            holds[best, expert] = True
            filled[best] += 1
    return table


def balance_score(stages: np.ndarray, replicas: np.ndarray,
                  table: np.ndarray) -> np.float32:
    """Mean over stages of (hottest rank * ranks + 0.01) / (total + 0.01), each replica
    carrying an equal share of its expert: 1.0 is perfect balance."""
    num_ranks, per_rank = table.shape
    share = stages / replicas  # [T, N] float64
    total = np.zeros(stages.shape[0])
    peak = np.zeros(stages.shape[0])
    for d in range(num_ranks):
        load = np.zeros(stages.shape[0])
        for k in range(per_rank):
            load = load + share[:, table[d, k]]
        total = total + load
        peak = np.maximum(peak, load)
    scores = ((peak * num_ranks + 1e-2) / (total + 1e-2)).astype(np.float32)
    return np.mean(scores)  # float32, as the ratios compared with it


def statistics(stages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean, variance and covariance (n - 1) of each expert's load over the stages."""
    t, n = stages.shape
    mean = np.mean(stages, axis=0)
    if t < 2:
        return mean, np.zeros(n), np.zeros((n, n))
    centered = stages - mean
    return mean, np.sum(centered ** 2, axis=0) / (t - 1), (centered.T @ centered) / (t - 1)


def search_layer(stages: np.ndarray, num_slots: int, num_ranks: int, depth: int = DEPTH,
                 width: int = WIDTH, z: float = Z_SCORE
                 ) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """Step 2 for one layer: (table [ranks, slots / ranks], replicas [N], score)."""
    mu, var, cov = statistics(stages)
    n = mu.shape[0]
    per_rank = num_slots // num_ranks
    free = num_slots - n

    def score_of(replicas: np.ndarray) -> tuple[np.float32, np.ndarray]:
        table = lpt_place(mu, var, cov, replicas, num_ranks, per_rank, z)
        return balance_score(stages, replicas, table), table

    if depth <= 1:
        replicas = min_max_replicas(mu, var, free, z)[-1]
        table = lpt_place(mu, var, cov, replicas, num_ranks, per_rank, z)
        return table, replicas, balance_score(stages, replicas, table)
    step = math.ceil(n / depth)
    order = np.argsort(-(mu + z * np.sqrt(var)))
    chosen = np.zeros(n, dtype=np.int32)
    for node in range(depth - 1):
        head, rest = order[node * step:(node + 1) * step], order[(node + 1) * step:]
        both = order[node * step:]
        start = min_max_replicas(mu[both], var[both], free, z)[-1]
        head_ways = min_max_replicas(mu[head], var[head], free, z)
        rest_ways = min_max_replicas(mu[rest], var[rest], free, z)

        def tried(k: int, head=head, rest=rest, head_ways=head_ways, rest_ways=rest_ways,
                  left=free) -> tuple[np.float32, np.ndarray]:
            replicas = chosen.copy()
            replicas[head] = head_ways[k]
            replicas[rest] = rest_ways[left - k]
            return score_of(replicas)

        best = _neighbour_search(0, free, int((start[:step] - 1).sum()), width, tried)
        chosen[head] = head_ways[best]
        free -= best
        if not free or node == depth - 2:
            chosen[rest] = rest_ways[free]
            break
    table = lpt_place(mu, var, cov, chosen, num_ranks, per_rank, z)
    return table, chosen, balance_score(stages, chosen, table)


def _neighbour_search(low: int, high: int, initial: int, reach: int, score) -> int:
    """The count in [initial - reach, initial + reach] within [low, high] that scores
    lowest, tried outward (left before right); the first such on a tie."""
    reach = min(max(initial - low, high - initial), reach)
    best, best_score = initial, score(initial)[0]
    for r in range(1, reach + 1):
        for k in (initial - r, initial + r):
            if low <= k <= high:
                s = score(k)[0]
                if s < best_score:
                    best, best_score = k, s
    return best


def assign_min_cost(cost: np.ndarray) -> np.ndarray:
    """The column each row of the square ``cost`` matrix gets in a least-cost
    assignment: shortest augmenting paths (Crouse 2016), rows in order, columns scanned
    from the last, an equal-cost column that ends a path preferred, as scipy's
    ``linear_sum_assignment`` scans them (so ties fall the same way)."""
    n = cost.shape[0]
    c = cost.astype(np.float64) - cost.min()
    u, v = np.zeros(n), np.zeros(n)
    path = np.full(n, -1)
    col_of = np.full(n, -1)  # column of each row
    row_of = np.full(n, -1)  # row of each column
    for current in range(n):
        shortest = np.full(n, np.inf)
        seen_rows = np.zeros(n, dtype=bool)
        seen_cols = np.zeros(n, dtype=bool)
        remaining = list(range(n - 1, -1, -1))
        low_val, i, sink = 0.0, current, -1
        while sink == -1:
            seen_rows[i] = True
            index, lowest = -1, np.inf
            for at, j in enumerate(remaining):
                reduced = low_val + c[i, j] - u[i] - v[j]
                if reduced < shortest[j]:
                    path[j] = i
                    shortest[j] = reduced
                if shortest[j] < lowest or (shortest[j] == lowest and row_of[j] == -1):
                    lowest, index = shortest[j], at
            low_val = lowest
            j = remaining[index]
            if row_of[j] == -1:
                sink = j
            else:
                i = row_of[j]
            seen_cols[j] = True
            remaining[index] = remaining[-1]
            remaining.pop()
        u[current] += low_val
        for r in range(n):
            if seen_rows[r] and r != current:
                u[r] += low_val - shortest[col_of[r]]
        v[seen_cols] -= low_val - shortest[seen_cols]
        j = sink
        while True:
            i = path[j]
            row_of[j] = i
            col_of[i], j = j, col_of[i]
            if i == current:
                break
    return col_of


def keep_in_place(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``new`` [ranks, per_rank] with its ranks matched to ``old``'s (most experts kept
    per rank) and, within a rank, each kept expert back in its old slot."""
    n, m = old.shape
    values = n * m
    have = np.stack([np.bincount(row[row != -1], minlength=values) for row in old])
    want = np.stack([np.bincount(row[row != -1], minlength=values) for row in new])
    matches = np.minimum(have[:, None, :], want[None, :, :]).sum(-1)  # [old, new]
    cols = assign_min_cost(m - matches)
    out = np.empty_like(new)
    for src, dst in enumerate(cols):
        row, target = old[src], new[dst]
        spots: dict[int, list[int]] = {}
        for pos, e in enumerate(target):
            spots.setdefault(int(e), []).append(pos)
        placed = np.zeros(m, dtype=bool)
        used: set[int] = set()
        for pos, e in enumerate(row):
            free = spots.get(int(e))
            if free:
                used.add(free.pop())
                out[src, pos] = e
                placed[pos] = True
        rest = iter(target[p] for p in range(m) if p not in used)
        for pos in range(m):
            if not placed[pos]:
                out[src, pos] = next(rest)
    return out


class FlashLB:
    """The policy with its memory: each layer's average-to-peak ratio when last placed
    (a layer is re-placed when it falls), and the sample size (it only shrinks)."""

    def __init__(self, depth: int = DEPTH, width: int = WIDTH, z: float = Z_SCORE):
        self.depth, self.width, self.z = depth, width, z
        self.sample_size = SAMPLE_SIZE
        self.history: dict[int, np.float32] = {}

    def thresholds(self, num_ranks: int) -> tuple[float, float]:
        """(share of the last ratio, floor) under which a layer is re-placed."""
        return (0.95, 0.9) if num_ranks < 32 else (0.9, 0.85)

    def rebalance(self, table: np.ndarray, hotness: np.ndarray
                  ) -> tuple[np.ndarray, list[int]]:
        """``table`` [layers, ranks, per_rank] the experts the ranks hold; ``hotness``
        [stages, layers, experts] each stage's tokens per expert plus its steps. Returns
        the new table and the layers that improved, most first (their ratios kept)."""
        num_layers, num_ranks, per_rank = table.shape
        stages = hotness.shape[0]
        self.sample_size = min(stages, self.sample_size)
        window = max(stages // self.sample_size, 1)
        sample = hotness[-window * self.sample_size:]
        sample = sample.reshape(-1, window, *hotness.shape[1:]).sum(1)
        ratio_share, floor = self.thresholds(num_ranks)
        out = table.copy()
        gain = np.zeros(num_layers, dtype=np.float32)
        ratios = np.zeros(num_layers, dtype=np.float32)
        for layer in range(num_layers):
            replicas = np.bincount(table[layer].ravel(), minlength=hotness.shape[2])
            now = 1 / balance_score(hotness[:, layer], replicas, table[layer])
            past = self.history.get(layer)
            if past is not None and not (now < past * ratio_share or now < floor):
                continue
            new, _, score = search_layer(sample[:, layer], num_ranks * per_rank, num_ranks,
                                         self.depth, self.width, self.z)
            ratios[layer] = 1 / score
            if not (new == -1).any():
                out[layer] = keep_in_place(table[layer], new)
            gain[layer] = ratios[layer] - now
        improved = [int(i) for i in np.argsort(-gain) if gain[i] > 0]
        for layer in improved:
            self.history[layer] = ratios[layer]
        return out, improved
