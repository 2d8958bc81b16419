"""vLLM-Ascend's SwiftBalance EPLB policy, transcribed rule by rule for the placement-
equivalence tests: ``SwiftBalanceEplb.rebalance_experts`` (vllm_ascend/eplb/core/policy/
policy_swift_balancer.py, vllm-ascend 182b75ea) with node-local redundancy off, as its
EPLB worker calls it: a [layer, rank, slot] expert table and per-slot workload in, the
new table out.

Deliberately written in that shape (its method names, its numpy arrays, its sets and
dicts) so that pdmesh's ``shared.parallel.swift_balance`` shares no code with it.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np


class SwiftBalanceReference:
    def __init__(self) -> None:
        self.num_max_com = 1
        self.imbalance_threshold = 1.01
        self.increment = 0.01
        self.swap_threshold = 0.0
        self.max_swap_times = 100

    def get_original_workload(self, table, workload, num_original):
        layer_num, npu_num, per_npu = workload.shape
        out = np.zeros((layer_num, num_original))
        for layer in range(layer_num):
            acc = defaultdict(int)
            for npu in range(npu_num):
                for k in range(per_npu):
                    acc[int(table[layer][npu][k])] += workload[layer][npu][k]
            for e in range(num_original):
                out[layer][e] = acc[e]
        return out

    def constraint_expert_local_exchange(self, old, new):
        for layer_id in range(len(new)):
            for card_id in range(len(new[layer_id])):
                current_list = [int(x) for x in old[layer_id][card_id]]
                new_list = [int(x) for x in new[layer_id][card_id]]
                num = len(new_list)
                new_index = [-1] * num
                new_result = [-1] * num
                remaining = []
                for i in range(num):
                    flag = True
                    for j in range(num):
                        if new_list[i] == current_list[j] and new_index[j] == -1:
                            new_index[j] = 0
                            new_result[j] = current_list[j]
                            flag = False
                            break
                    if flag:
                        remaining.append(new_list[i])
                index = 0
                for k in range(num):
                    if new_result[k] == -1:
                        new_result[k] = remaining[index]
                        index += 1
                new[layer_id][card_id] = new_result

    def calculate_imbalance(self, deployment, loads):
        per_layer = []
        num_per_expert = np.zeros_like(loads)
        for layer_id, layer in enumerate(deployment):
            for rank in layer:
                for expert_id in rank:
                    num_per_expert[layer_id][expert_id] += 1
        for layer_id, layer in enumerate(deployment):
            cur_max = 0
            total = 0
            for rank in layer:
                rank_load = 0
                for expert_id in rank:
                    w = loads[layer_id][expert_id] / num_per_expert[layer_id][expert_id]
                    rank_load += w
                    total += w
                if cur_max < rank_load:
                    cur_max = rank_load
            avg = total / self.num_ranks
            per_layer.append(1.0 if abs(avg) < 1e-9 else cur_max / avg)
        return per_layer

    def statistics_expert_distribution(self, dep):
        num_ranks = len(dep)
        pos = [[] for _ in range(num_ranks)]
        n_red = 0
        from_rank = np.zeros(self.num_original_experts, dtype=np.int64)
        existing = set()
        for index in range(self.num_experts_per_rank):
            for rank_id in range(num_ranks):
                e = int(dep[rank_id][index])
                if e not in existing:
                    existing.add(e)
                    from_rank[e] = rank_id
                else:
                    pos[rank_id].append(index)
                    n_red += 1
        return pos, from_rank, existing, n_red

    def compute_redundant_assignments(self, initial_weights, n_red, num_ranks):
        current = initial_weights.copy()
        assign = np.zeros(self.num_original_experts, dtype=np.int64)
        for _ in range(n_red):
            order = np.argsort([w for _, w in current], kind="stable")[::-1]
            for index in order:
                expert_id, w = current[index]
                cur = assign[expert_id] + 1
                if cur < num_ranks:
                    new_avg = w * (cur + 1) / (cur + 2)
                    assign[expert_id] += 1
                    current[index] = (expert_id, new_avg)
                    break
        update = np.zeros(self.num_original_experts, dtype=np.float32)
        for expert_id, w in current:
            update[expert_id] = w
        red_list = []
        if n_red > 0:
            for expert_id in range(self.num_original_experts):
                for _ in range(assign[expert_id]):
                    red_list.append((expert_id, float(update[expert_id])))
            red_list.sort(key=lambda x: x[1], reverse=True)
        return red_list, update

    def recomputing_initial_weight(self, initial_weights, assignments):
        counts = np.zeros(self.num_original_experts, dtype=np.int64)
        for rank in assignments:
            for e in rank:
                if e != -1:
                    counts[e] += 1
        update = np.full(self.num_original_experts, fill_value=-1, dtype=np.float32)
        for e, w in initial_weights:
            assert counts[e] != 0
            update[e] = w / counts[e]
        return update, counts

    def fill_in_undeployed_ranks(self, initial_weights, assignments, undeployed, pos, com,
                                 rev, from_rank):
        update, counts = self.recomputing_initial_weight(initial_weights, assignments)
        for rank_idx in undeployed:
            for p in pos[rank_idx]:
                order = np.argsort(update, kind="stable")[::-1]
                for e in order:
                    send = from_rank[e]
                    if e in assignments[rank_idx]:
                        continue
                    if np.isclose(update[e], -1):
                        raise ValueError(f"Expert ID {e} is not in the node")
                    assignments[rank_idx][p] = e
                    com[send][rank_idx] += 1
                    rev[rank_idx].add(e)
                    n = counts[e]
                    update[e] *= n / (n + 1)
                    counts[e] += 1
                    break
        loads = np.zeros(len(assignments), dtype=np.float32)
        for rank_id, rank in enumerate(assignments):
            for e in rank:
                loads[rank_id] += update[e]
        return update, loads

    def non_redundant_expert_information(self, dep, weights, pos):
        n = dep.shape[0]
        assignments = np.full((n, self.num_experts_per_rank), fill_value=-1, dtype=np.int64)
        loads = np.zeros(n, dtype=np.float32)
        for rank_id, rank in enumerate(dep):
            for index, e in enumerate(rank):
                if index in pos[rank_id]:
                    continue
                assignments[rank_id][index] = e
                loads[rank_id] += weights[e]
        return assignments, loads

    def distribute_redundant_experts(self, assignments, loads, red_list, from_rank, pos):
        num_ranks = len(assignments)
        rev = defaultdict(set)
        com = np.zeros((num_ranks, num_ranks), dtype=np.int64)
        for e, w in red_list:
            candidate = -1
            send = from_rank[e]
            for rank_id in range(num_ranks):
                if len(pos[rank_id]) == 0:
                    continue
                if e in assignments[rank_id]:
                    continue
                if com[send][rank_id] >= self.num_max_com:
                    continue
                if candidate == -1 or loads[rank_id] < loads[candidate]:
                    candidate = rank_id
            if candidate != -1:
                p = pos[candidate].pop()
                assignments[candidate][p] = e
                loads[candidate] += w
                com[send][candidate] += 1
                rev[candidate].add(e)
        undeployed = [r for r in range(num_ranks) if len(pos[r]) > 0]
        return com, rev, undeployed

    def redundancy_again(self, workload, dep):
        num_ranks = dep.shape[0]
        pos, from_rank, existing, n_red = self.statistics_expert_distribution(dep)
        initial = [(e, workload[e]) for e in existing]
        red_list, weights = self.compute_redundant_assignments(initial, n_red, num_ranks)
        assignments, loads = self.non_redundant_expert_information(dep, weights, pos)
        com, rev, undeployed = self.distribute_redundant_experts(assignments, loads, red_list,
                                                                 from_rank, pos)
        if undeployed:
            weights, loads = self.fill_in_undeployed_ranks(initial, assignments, undeployed,
                                                           pos, com, rev, from_rank)
        return assignments, loads, weights, com, rev

    def swap_experts_between_ranks(self, max_set, swap_set, max_rev, swap_rev, workload,
                                   max_load, swap_load):
        max_e, swap_e, max_weight = -1, -1, max_load
        for cur in max_set:
            if cur in swap_set or cur in max_rev:
                continue
            cur_w = float(workload[cur])
            for nxt in swap_set:
                if nxt in max_set or nxt in swap_rev:
                    continue
                nxt_w = float(workload[nxt])
                after = max(max_load - cur_w + nxt_w, swap_load - nxt_w + cur_w)
                if after < max_weight:
                    max_weight, max_e, swap_e = after, cur, nxt
        return max_e, swap_e, max_weight

    def expert_exchange_between_ranks(self, assignments, loads, com, rev, weights):
        sets = [set(assignments[r]) for r in range(len(assignments))]
        times = self.max_swap_times
        max_load = 0.0
        exchange = True
        while times > 0:
            times -= 1
            order = np.argsort(loads, kind="stable")
            max_id = int(order[-1])
            max_load = float(loads[max_id])
            if not exchange:
                break
            exchange = False
            for swap_id in order[:-1]:
                if com[swap_id][max_id] < self.num_max_com and \
                        com[max_id][swap_id] < self.num_max_com:
                    swap_load = loads[swap_id]
                    max_e, swap_e, max_weight = self.swap_experts_between_ranks(
                        sets[max_id], sets[swap_id], rev[max_id], rev[swap_id], weights,
                        max_load, swap_load)
                    if max_load - max_weight < self.swap_threshold or max_e == -1:
                        continue
                    sets[max_id].remove(max_e)
                    sets[swap_id].remove(swap_e)
                    sets[max_id].add(swap_e)
                    sets[swap_id].add(max_e)
                    loads[max_id] += weights[swap_e] - weights[max_e]
                    loads[swap_id] += weights[max_e] - weights[swap_e]
                    rev[max_id].add(swap_e)
                    rev[swap_id].add(max_e)
                    com[swap_id][max_id] += 1
                    com[max_id][swap_id] += 1
                    exchange = True
                    break
        return [list(s) for s in sets], max_load

    def rebalance_experts(self, table: np.ndarray, workload: np.ndarray) -> list:
        self.num_layers, self.num_ranks, self.num_experts_per_rank = table.shape
        self.num_original_experts = len(np.unique(table[0]))
        loads = self.get_original_workload(table, workload, self.num_original_experts)
        ave = loads[0].sum() / self.num_ranks
        self.swap_threshold = ave * self.increment
        initial = self.calculate_imbalance(table, loads)
        new = table.copy()
        for layer in range(self.num_layers):
            if initial[layer] < self.imbalance_threshold:
                continue
            assignments, rank_loads, weights, com, rev = self.redundancy_again(
                loads[layer], table[layer])
            dep, max_load = self.expert_exchange_between_ranks(assignments, rank_loads, com,
                                                               rev, weights)
            if max_load / ave < initial[layer]:
                new[layer] = np.array(dep)
        self.constraint_expert_local_exchange(table, new)
        return new.tolist()
