"""vLLM-Ascend's FlashLB EPLB policy, transcribed for the placement-equivalence tests:
``FlashLB.rebalance_experts`` (vllm_ascend/eplb/core/policy/policy_flashlb.py, vllm-ascend
182b75ea) as its EPLB worker calls it: a [layer, rank, slot] expert table and a per-slot
workload series [stage, layer, rank, slot] in, the new table out.

Its numba kernels are written here as the plain loops they compile from (numba is not a
dependency), its Hungarian step is scipy's ``linear_sum_assignment`` itself, and the
one undefined case (no rank can take a replica: more replicas of an expert than ranks,
where the numba build writes past the table) leaves the replica out, as pdmesh does; the
whole keeps upstream's shape (its class, method names, loops and buffers) so that
pdmesh's ``shared.parallel.flash_lb`` shares no code with it.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import linear_sum_assignment

Z = 0.6744897501960817  # scipy.stats.norm.ppf(0.75)


def min_max_replica(mu, var, num_available_replicas, current_replicas, z_score):
    n = mu.shape[0]
    unit_value = (mu + z_score * np.sqrt(var)) / current_replicas
    history = np.ones((num_available_replicas + 1, n), dtype=np.int32)
    history[0, :] = current_replicas[:]
    for r in range(num_available_replicas):
        max_idx, max_value = -1, -1.0
        for idx in range(n):
            if unit_value[idx] > max_value:
                max_value, max_idx = unit_value[idx], idx
        current_replicas[max_idx] += 1
        unit_value[max_idx] = ((mu[max_idx] + z_score * np.sqrt(var[max_idx]))
                               / current_replicas[max_idx])
        history[r + 1, :] = current_replicas[:]
    return current_replicas, history


def updated_variance(new_id, slots, current_var, var, cov, replicas):
    new_var = current_var + var[new_id] / replicas[new_id] ** 2
    for slot in slots:
        if slot == -1:
            break
        new_var += 2 * cov[new_id, slot] / replicas[new_id] / replicas[slot]
    return new_var


def lpt_deployment(mu, var, cov, deployment, deployed_replicas, total_replicas, z_score):
    num_devices, per_device = deployment.shape
    order = np.argsort(-(mu / total_replicas))
    new = -np.ones_like(deployment)
    dev_mu = np.zeros(num_devices, dtype=np.float32)
    dev_var = np.zeros(num_devices, dtype=np.float32)
    ptr = np.zeros(num_devices, dtype=np.int32)
    for idx in order:
        for _ in range(total_replicas[idx] - deployed_replicas[idx]):
            best_dev, best_risk, best_mu, best_var = -1, 1e30, -1.0, -1.0
            for dev in range(num_devices):
                if ptr[dev] >= per_device or idx in new[dev]:
                    continue
                temp_mu = dev_mu[dev] + mu[idx] / total_replicas[idx]
                temp_var = updated_variance(idx, new[dev], dev_var[dev], var, cov,
                                            total_replicas)
                risk = temp_mu + z_score * np.sqrt(temp_var)
                if risk < best_risk:
                    best_risk, best_dev, best_mu, best_var = risk, dev, temp_mu, temp_var
            if best_dev == -1:  # upstream's numba build writes out of bounds here
                continue
            dev_mu[best_dev] = best_mu
            dev_var[best_dev] = best_var
            new[best_dev, ptr[best_dev]] = idx
            ptr[best_dev] += 1
    return new


def compute_score(val_data, replicas, deployment):
    t_len, _ = val_data.shape
    d_len, k_len = deployment.shape
    scores = np.empty((t_len,), dtype=np.float32)
    for t in range(t_len):
        max_load, tot_load = 0.0, 0.0
        for d in range(d_len):
            s = 0.0
            for k in range(k_len):
                idx = deployment[d, k]
                s += val_data[t, idx] / replicas[idx]
            tot_load += s
            max_load = max(max_load, s)
        scores[t] = (max_load * d_len + 1e-2) / (tot_load + 1e-2)
    return np.mean(scores)


class FlashTree:
    def __init__(self, X, num_replicas, num_devices, z_score, depth, width):
        self.X, self.num_replicas, self.num_devices = X, num_replicas, num_devices
        self.z_score, self.depth, self.width = z_score, depth, width
        t_len, n = X.shape
        self.mu = np.mean(X, axis=0)
        if t_len > 1:
            centered = X - self.mu
            self.var = np.sum(centered ** 2, axis=0) / (t_len - 1)
            self.cov = (centered.T @ centered) / (t_len - 1)
        else:
            self.var, self.cov = np.zeros((n,)), np.zeros((n, n))

    def neighbor_search(self, low, high, initial, max_range, get_score):
        max_range = min(max(initial - low, high - initial), max_range)
        best_x = initial
        best_score, best_sim = get_score(initial)
        for r in range(1, max_range + 1):
            left = initial - r
            if left >= low:
                score, sim = get_score(left)
                if score < best_score:
                    best_x, best_score, best_sim = left, score, sim
            right = initial + r
            if right <= high:
                score, sim = get_score(right)
                if score < best_score:
                    best_x, best_score, best_sim = right, score, sim
        return best_x, best_score, best_sim

    def optimize_balanceness(self):
        mu, var, cov, z = self.mu, self.var, self.cov, self.z_score
        num_experts = mu.shape[0]
        available = self.num_replicas - num_experts
        shape = (self.num_devices, self.num_replicas // self.num_devices)
        interval = math.ceil(num_experts / self.depth)
        idx = np.argsort(-(mu + z * np.sqrt(var)))
        deployed = np.zeros(num_experts, dtype=np.int32)

        def get_score(ci, cr, ri, rr):
            sim = deployed.copy()
            sim[ci] = cr
            sim[ri] = rr
            dep = lpt_deployment(mu, var, cov, -np.ones(shape, dtype=np.int32),
                                 np.zeros_like(sim), sim, z)
            return compute_score(self.X, sim, dep), dep

        for node in range(self.depth - 1):
            high = available
            sim_idx = idx[node * interval:]
            cur_idx = idx[node * interval:(node + 1) * interval]
            rem_idx = idx[(node + 1) * interval:]
            sim_rep = min_max_replica(mu[sim_idx], var[sim_idx], high,
                                      np.ones(sim_idx.shape[0], dtype=np.int32), z)[0]
            cur_f = min_max_replica(mu[cur_idx], var[cur_idx], high,
                                    np.ones(cur_idx.shape[0], dtype=np.int32), z)[1]
            rem_f = min_max_replica(mu[rem_idx], var[rem_idx], high,
                                    np.ones(rem_idx.shape[0], dtype=np.int32), z)[1]
            initial = (sim_rep[:interval] - 1).sum()
            best, _, _ = self.neighbor_search(
                0, high, initial, self.width,
                lambda mid, ci=cur_idx, cf=cur_f, ri=rem_idx, rf=rem_f, nar=available:
                    get_score(ci, cf[mid], ri, rf[nar - mid]))
            deployed[cur_idx] = cur_f[best]
            available -= best
            if not available or node == self.depth - 2:
                deployed[rem_idx] = rem_f[available]
                break
        final = lpt_deployment(mu, var, cov, -np.ones(shape, dtype=np.int32),
                               np.zeros_like(deployed), deployed, z)
        return final, deployed, compute_score(self.X, deployed, final)


class FlashLBReference:
    def __init__(self, world_size):
        self.update_threshold_ratio, self.update_threshold_value = 0.9, 0.85
        if world_size < 32:
            self.update_threshold_ratio, self.update_threshold_value = 0.95, 0.9
        self.depth, self.width, self.sample_size = 4, 8, 64
        self.average_to_peak_history = {}
        self.hotness_window = {}
        self.current_deployment = {}
        self.current_deployed_replicas = {}

    def register_hotness(self, deployment, rank_load, num_layers, num_experts):
        stages = rank_load.shape[0]
        hotness = np.zeros((stages, num_layers, num_experts), dtype=rank_load.dtype)
        for stage in range(stages):
            for layer in range(num_layers):
                np.add.at(hotness[stage, layer], deployment[layer].ravel(),
                          rank_load[stage, layer].ravel())
        hotness += 1
        window = self.max_observation_window
        for layer in range(num_layers):
            new_x = hotness[-window:, layer, :]
            t = new_x.shape[0]
            if layer not in self.hotness_window:
                self.hotness_window[layer] = {
                    "buffer": np.zeros((window, num_experts), dtype=new_x.dtype),
                    "start": 0, "length": 0}
            info = self.hotness_window[layer]
            buf, start = info["buffer"], info["start"]
            if start + t <= window:
                buf[start:start + t] = new_x
            else:
                first = window - start
                buf[start:] = new_x[:first]
                buf[:t - first] = new_x[first:]
            info["start"] = (start + t) % window
            info["length"] = min(window, info["length"] + t)

    def need_update(self, layer):
        past = self.average_to_peak_history.get(layer, 0.0)
        if past == 0.0:
            return True
        ratio = 1 / compute_score(self.hotness_window[layer]["buffer"],
                                  self.current_deployed_replicas[layer],
                                  self.current_deployment[layer])
        return (ratio < past * self.update_threshold_ratio
                or ratio < self.update_threshold_value)

    @staticmethod
    def minimize_redeploy_with_inner_permutation(src, dst):
        n, m = src.shape
        src_counts = np.array([np.bincount(r[r != -1], minlength=n * m) for r in src],
                              dtype=np.int32)
        dst_counts = np.array([np.bincount(r[r != -1], minlength=n * m) for r in dst],
                              dtype=np.int32)
        matches = np.zeros((n, n), dtype=np.int32)
        for i in range(n):
            for j in range(n):
                matches[i, j] = sum(min(src_counts[i, k], dst_counts[j, k])
                                    for k in range(n * m))
        row_ind, col_ind = linear_sum_assignment(m - matches)
        out = np.empty_like(dst)
        for src_idx, dst_idx in zip(row_ind.tolist(), col_ind.tolist(), strict=True):
            s_row, d_row = src[src_idx], dst[dst_idx]
            positions = {}
            for pos, v in enumerate(d_row):
                positions.setdefault(v, []).append(pos)
            reordered = np.empty(m, dtype=dst.dtype)
            assigned = [False] * m
            used = set()
            for pos_src, v in enumerate(s_row):
                p = positions.get(v)
                if p:
                    used.add(p.pop())
                    reordered[pos_src] = v
                    assigned[pos_src] = True
            remaining = [d_row[p] for p in range(m) if p not in used]
            ri = 0
            for pos in range(m):
                if not assigned[pos]:
                    reordered[pos] = remaining[ri]
                    ri += 1
            out[src_idx] = reordered
        return out

    def rebalance_experts(self, current_expert_table, expert_workload):
        current = np.array(current_expert_table)
        workload = np.array(expert_workload)
        self.max_observation_window = workload.shape[0]
        self.sample_size = min(self.max_observation_window, self.sample_size)
        num_layers = workload.shape[1]
        num_expert = np.unique(current[0].reshape(-1)).shape[0]
        num_devices = current.shape[1]
        num_replicas = len(current[0].reshape(-1))
        self.register_hotness(current, workload, num_layers, num_expert)
        for layer in range(num_layers):
            self.current_deployment[layer] = current[layer]
            self.current_deployed_replicas[layer] = np.bincount(
                current[layer].reshape(-1), minlength=num_expert)
        new_deployment = np.zeros((num_layers, num_devices, num_replicas // num_devices),
                                  dtype=np.int32)
        new_replicas = np.zeros((num_layers, num_expert), dtype=np.int32)
        new_ratio = np.zeros((num_layers,), dtype=np.float32)
        delta = np.zeros((num_layers,), dtype=np.float32)
        for layer in range(num_layers):
            if not self.need_update(layer):
                new_deployment[layer] = self.current_deployment[layer]
                new_replicas[layer] = self.current_deployed_replicas[layer]
                new_ratio[layer] = self.average_to_peak_history.get(layer, 0.0)
                continue
            info = self.hotness_window[layer]
            buf, start, length = info["buffer"], info["start"], info["length"]
            data = buf[np.arange(start, start + length) % self.max_observation_window]
            window = max(length // self.sample_size, 1)
            data = data[-window * self.sample_size:].reshape(
                (-1, window, *data.shape[1:])).sum(1)
            tree = FlashTree(data, num_replicas, num_devices, Z, self.depth, self.width)
            best_deployment, best_replicas, best_score = tree.optimize_balanceness()
            new_replicas[layer] = best_replicas
            new_ratio[layer] = 1 / best_score
            cur = self.current_deployment[layer]
            if -1 in best_deployment:
                new_deployment[layer] = cur
            else:
                new_deployment[layer] = self.minimize_redeploy_with_inner_permutation(
                    cur, best_deployment)
            delta[layer] = new_ratio[layer] - 1 / compute_score(
                buf, self.current_deployed_replicas[layer], cur)
        priority = np.argsort(-delta)
        priority = priority[delta[priority] > 0]
        for layer in priority:
            self.current_deployment[layer] = new_deployment[layer]
            self.current_deployed_replicas[layer] = new_replicas[layer]
            self.average_to_peak_history[layer] = new_ratio[layer]
        return len(priority) > 0, priority, new_deployment
