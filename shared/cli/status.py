"""`pdmesh status`: the live mesh at a glance.

    pdmesh status                      # instances, KV pool and EPLB, once
    pdmesh status --watch 2            # redrawn every 2 s until Ctrl-C
    pdmesh status --json               # the same data for scripts (one object a line)

Three sources, asked in this order:

    redis registry ──▶ live instances, their load as of their last heartbeat
    kvstore Stats  ──▶ the pool's keys, bytes, hits and misses
    eplb Status    ──▶ per DP group: published placement version, balancedness

A kvstore or controller that does not answer within ``--rpc-timeout`` shows as
unreachable; only redis being down is fatal (one line naming the URL, exit status 2).
Nothing here imports torch, so the command answers in well under a second.

EPLB groups are named ``<role>@<dp host>:<dp rpc port>``; every DP rank registers its
group, so the DP instances in the registry (prefill / decode / mixed with dp_size > 1)
are matched to the controller's figures directly. ``--eplb-group`` adds a group by name.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import grpc
import redis

from pdmesh.shared.infra import cluster_auth
from pdmesh.shared.infra.registry import ROLES, Instance, Registry
from pdmesh.shared.infra.signals import SignalStop
from pdmesh.shared.proto import eplb_pb2, eplb_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc

DP_ROLES = ("prefill", "decode", "mixed")
CLEAR_SCREEN = "\x1b[H\x1b[2J"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--registry-prefix", default="pdmesh",
                   help="redis key prefix of the mesh to show")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                   help="redraw every SECONDS until Ctrl-C")
    p.add_argument("--rpc-timeout", type=float, default=1.0, metavar="SECONDS",
                   help="how long the kvstore and the EPLB controller get to answer")
    p.add_argument("--eplb-group", action="append", default=[], metavar="ROLE@HOST:PORT",
                   help="also ask the controller about this group (repeatable); the DP "
                        "launcher's ready line names it as eplb_group")


@dataclass(frozen=True)
class InstanceStatus:
    role: str
    id: str
    address: str
    model: str
    dp_rank: int
    dp_size: int
    running: int
    waiting: int
    kv_cache_usage_perc: float | None  # 1 - free/total, 0..1 as vLLM's; None: no KV cache
    placement_version: int  # the EPLB placement the rank runs (0: its start placement)
    heartbeat_age_s: float
    draining: bool
    # speculative decoding: accepted / draft tokens since start (None: no drafts yet)
    spec_acceptance: float | None = None
    lora_adapters: list[str] = field(default_factory=list)  # held in its host memory
    # KV tiers: the host tier's (blocks held, capacity), blocks read back from it and from
    # storage, blocks asked of them (None: no tiers)
    kv_tiers: tuple[int, int, int, int, int] | None = None


@dataclass(frozen=True)
class PoolStatus:
    id: str
    address: str
    reachable: bool
    keys: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    hit_rate: float | None = None  # hits / (hits + misses); None before any lookup
    error: str = ""  # why it is unreachable


@dataclass(frozen=True)
class EplbGroupStatus:
    group: str  # the controller's name for it; "" when the registry cannot tell
    role: str
    host: str
    model: str
    dp_size: int
    ranks: list[int]  # dp ranks registered
    rank_versions: list[int]  # distinct placement versions the registered ranks run
    version: int | None = None  # the controller's published version
    mean_balancedness: float | None = None  # mean over layers; None before any report
    reports: int = 0
    error: str = ""


@dataclass(frozen=True)
class MeshStatus:
    redis_url: str
    prefix: str
    time: float
    instances: list[InstanceStatus]
    pools: list[PoolStatus]  # one per registered kvstore
    eplb_controller: str | None  # "id at host:port"; None when none is registered
    eplb_groups: list[EplbGroupStatus] = field(default_factory=list)
    lora_adapters: dict[str, str] = field(default_factory=dict)  # served: name -> folder


def collect(registry: Registry, redis_url: str, groups: Sequence[str] = (),
            rpc_timeout_s: float = 1.0) -> MeshStatus:
    """One snapshot; redis.RedisError when the registry cannot be read."""
    now = time.time()
    found = registry.instances()
    order = {role: i for i, role in enumerate(ROLES)}
    found.sort(key=lambda i: (order.get(i.role, len(ROLES)), i.model, i.address, i.dp_rank))
    controllers = [i for i in found if i.role == "eplb"]
    controller = controllers[0] if controllers else None
    return MeshStatus(
        redis_url=_safe_url(redis_url), prefix=registry.prefix, time=now,
        instances=[_instance_status(i, now) for i in found],
        pools=[_pool_status(i, rpc_timeout_s) for i in found if i.role == "kvstore"],
        eplb_controller=f"{controller.id} at {controller.address}" if controller else None,
        eplb_groups=_eplb_groups(found, list(groups), controller, rpc_timeout_s),
        lora_adapters=registry.adapters())


def _instance_status(inst: Instance, now: float) -> InstanceStatus:
    total = inst.load.get("total_kv_blocks", 0)
    usage = 1 - inst.load.get("free_kv_blocks", 0) / total if total > 0 else None
    return InstanceStatus(
        role=inst.role, id=inst.id, address=inst.address, model=inst.model,
        dp_rank=inst.dp_rank, dp_size=inst.dp_size, running=inst.load.get("running", 0),
        waiting=inst.load.get("waiting", 0), kv_cache_usage_perc=usage,
        placement_version=inst.load.get("placement_version", 0),
        heartbeat_age_s=max(0.0, now - inst.heartbeat), draining=inst.draining,
        spec_acceptance=(inst.load.get("spec_accepted_tokens", 0) / drafted
                         if (drafted := inst.load.get("spec_draft_tokens", 0)) else None),
        lora_adapters=list(inst.adapters),
        kv_tiers=tuple(inst.load.get(k, 0) for k in (  # type: ignore[arg-type]
            "tier_host_blocks", "tier_host_capacity", "tier_host_hits", "tier_storage_hits",
            "tier_queries")) if inst.load.get("tier_host_capacity") else None)


def _pool_status(inst: Instance, timeout_s: float) -> PoolStatus:
    with cluster_auth.channel(inst.address) as channel:
        try:
            s = kvstore_pb2_grpc.KVStoreStub(channel).Stats(kvstore_pb2.StatsRequest(),
                                                            timeout=timeout_s)
        except grpc.RpcError as e:
            return PoolStatus(inst.id, inst.address, reachable=False, error=e.code().name)
    lookups = s.hits + s.misses
    return PoolStatus(inst.id, inst.address, True, s.keys, s.bytes, s.hits, s.misses,
                      s.hits / lookups if lookups else None)


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0]


def _eplb_groups(found: list[Instance], names: list[str], controller: Instance | None,
                 timeout_s: float) -> list[EplbGroupStatus]:
    """The DP groups the registry shows, each matched to a ``names`` entry of the same
    role and host; names that match no registered group get a row of their own."""
    ranks: dict[tuple[str, str, str, int, str], list[Instance]] = {}
    for i in found:
        if i.role in DP_ROLES and i.dp_size > 1:
            key = (i.role, _host(i.address), i.model, i.dp_size, i.group)
            ranks.setdefault(key, []).append(i)
    unmatched = list(names)
    rows = []
    for (role, host, model, dp_size, group), members in ranks.items():
        # ranks register their group (the controller's name for it); --eplb-group
        # names one for ranks of older versions that do not
        name = group or next((n for n in unmatched if n.startswith(f"{role}@{host}:")), "")
        if name in unmatched:
            unmatched.remove(name)
        versions = sorted({m.load.get("placement_version", 0) for m in members})
        rows.append(EplbGroupStatus(name, role, host, model, dp_size,
                                    sorted(m.dp_rank for m in members), versions))
    for name in unmatched:
        role, _, address = name.partition("@")
        rows.append(EplbGroupStatus(name, role, _host(address), "", 0, [], []))
    if controller is None:
        return rows
    with cluster_auth.channel(controller.address) as channel:
        stub = eplb_pb2_grpc.EplbStub(channel)
        return [_ask_controller(stub, row, timeout_s) if row.group else row for row in rows]


def _ask_controller(stub: eplb_pb2_grpc.EplbStub, row: EplbGroupStatus,
                    timeout_s: float) -> EplbGroupStatus:
    try:
        s = stub.Status(eplb_pb2.StatusRequest(group=row.group), timeout=timeout_s)
    except grpc.RpcError as e:
        return EplbGroupStatus(**{**asdict(row), "error": f"unreachable ({e.code().name})"})
    mean = sum(s.balancedness) / len(s.balancedness) if s.balancedness else None
    return EplbGroupStatus(**{**asdict(row), "version": s.version, "mean_balancedness": mean,
                              "reports": s.reports, "dp_size": row.dp_size or s.dp_size})


def _safe_url(url: str) -> str:
    """``url`` with its password, if any, replaced by ***."""
    return re.sub(r"//([^:@/]*):[^@/]*@", r"//\1:***@", url)


def render(s: MeshStatus) -> str:
    if not s.instances:
        return f"no instances registered under prefix {s.prefix}"
    lines = [f"INSTANCES  prefix {s.prefix}, {len(s.instances)} live, redis {s.redis_url}"]
    lines += _table(
        ["ROLE", "ID", "ADDRESS", "MODEL", "DP", "RUN", "WAIT", "KV%", "SPEC ACC%",
         "PLACEMENT", "HEARTBEAT", "DRAINING"],
        [[i.role, i.id, i.address, _short(i.model), f"{i.dp_rank}/{i.dp_size}",
          str(i.running), str(i.waiting),
          f"{100 * i.kv_cache_usage_perc:.1f}" if i.kv_cache_usage_perc is not None else "-",
          f"{100 * i.spec_acceptance:.1f}" if i.spec_acceptance is not None else "",
          f"v{i.placement_version}" if i.placement_version else "",
          f"{i.heartbeat_age_s:.1f}s ago", "yes" if i.draining else ""]
         for i in s.instances])
    lines += ["", "KV POOL"]
    lines += [f"  {_pool_line(p)}" for p in s.pools] or ["  no kvstore registered"]
    lines += ["", "EPLB"]
    if s.eplb_controller is None:
        lines.append("  no controller registered")
    else:
        lines.append(f"  controller {s.eplb_controller}")
    if s.eplb_groups:
        lines += ["  " + row for row in _table(
            ["GROUP", "MODEL", "RANKS", "RANKS RUN", "VERSION", "BALANCEDNESS"],
            [[g.group or f"{g.role}@{g.host}", _short(g.model),
              f"{len(g.ranks)}/{g.dp_size or '?'}",
              ", ".join(f"v{v}" for v in g.rank_versions) or "-", *_controller_cells(s, g)]
             for g in s.eplb_groups])]
    elif s.eplb_controller is not None:
        lines.append("  no DP groups (no prefill/decode instance with dp_size > 1)")
    return "\n".join(lines + _tier_lines(s) + _lora_lines(s))


def _tier_lines(s: MeshStatus) -> list[str]:
    """Each instance's KV tiers (none with tiers: no section)."""
    rows = [(i, i.kv_tiers) for i in s.instances if i.kv_tiers is not None]
    if not rows:
        return []
    return ["", "KV TIERS"] + ["  " + row for row in _table(
        ["ID", "HOST BLOCKS", "HOST HITS", "STORAGE HITS", "HIT RATE"],
        [[i.id, f"{held}/{cap}", str(host), str(storage),
          f"{100 * (host + storage) / asked:.1f}%" if asked else "-"]
         for i, (held, cap, host, storage, asked) in rows])]


def _lora_lines(s: MeshStatus) -> list[str]:
    """The LoRA adapters the mesh serves and the instances holding each (none: no
    section)."""
    held = {n for i in s.instances for n in i.lora_adapters}
    if not s.lora_adapters and not held:
        return []
    names = [*s.lora_adapters, *sorted(held - set(s.lora_adapters))]
    return ["", "LORA ADAPTERS"] + ["  " + row for row in _table(
        ["NAME", "FOLDER", "HELD BY"],
        [[n, s.lora_adapters.get(n, "(not served)"),
          ", ".join(i.id for i in s.instances if n in i.lora_adapters) or "-"]
         for n in names])]


def _pool_line(p: PoolStatus) -> str:
    if not p.reachable:
        return f"{p.id} at {p.address}: unreachable ({p.error})"
    rate = f"{100 * p.hit_rate:.1f}%" if p.hit_rate is not None else "-"
    return (f"{p.id} at {p.address}: {p.keys} keys, {_bytes(p.bytes)}, {p.hits} hits, "
            f"{p.misses} misses, hit rate {rate}")


def _controller_cells(s: MeshStatus, g: EplbGroupStatus) -> list[str]:
    if s.eplb_controller is None:
        return ["-", "-"]
    if g.error:
        return [g.error, ""]
    if not g.group:
        return ["name unknown (--eplb-group)", ""]
    if g.version is None:
        return ["-", "-"]
    bal = f"{g.mean_balancedness:.3f}" if g.mean_balancedness is not None else "no reports"
    return [str(g.version), bal]


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[c]) for r in [headers, *rows]) for c in range(len(headers))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
            for r in [headers, *rows]]


def _short(text: str, width: int = 32) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def run(a: argparse.Namespace) -> int:
    if a.watch is not None and not (math.isfinite(a.watch) and a.watch > 0):
        raise ValueError(f"--watch: must be a positive number of seconds, got {a.watch}")
    if not (math.isfinite(a.rpc_timeout) and a.rpc_timeout > 0):
        raise ValueError(f"--rpc-timeout: must be a positive number, got {a.rpc_timeout}")
    for name in a.eplb_group:
        if "@" not in name:
            raise ValueError(f"--eplb-group: must be ROLE@HOST:PORT, got {name!r}")
    registry = Registry(a.redis_url, a.registry_prefix)
    if a.watch is None:
        try:
            s = collect(registry, a.redis_url, a.eplb_group, a.rpc_timeout)
        except redis.RedisError as e:
            print(_redis_error(a.redis_url, e), file=sys.stderr)
            return 2
        print(json.dumps(asdict(s)) if a.json else render(s))
        return 0
    # Ctrl-C (or SIGTERM) ends the watch between two snapshots: the handler only counts
    # it, so no redis read or gRPC call is cut off midway and the exit cannot hang there
    stop = SignalStop().install()
    while not stop.is_set():  # a redis outage is shown, not fatal: the operator watches it
        try:
            s = collect(registry, a.redis_url, a.eplb_group, a.rpc_timeout)
            text = json.dumps(asdict(s)) if a.json else render(s)
        except redis.RedisError as e:
            text = _redis_error(a.redis_url, e)
            text = json.dumps({"error": text}) if a.json else text
        stamp = time.strftime("%H:%M:%S")
        print(text if a.json else f"{CLEAR_SCREEN}{stamp}  every {a.watch:g}s\n{text}",
              flush=True)
        stop.wait(a.watch)
    return 0


def _redis_error(url: str, e: redis.RedisError) -> str:
    return f"pdmesh status: error: cannot read the registry at {_safe_url(url)}: {e}"
