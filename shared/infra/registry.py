"""The instance registry in redis: who serves what, where, and how loaded.

    <prefix>:instance:<id>  hash {role, address, model, dp_size, running, waiting,
                                  free_kv_blocks, total_kv_blocks, heartbeat,
                                  adapters}  EXPIRE ttl
    <prefix>:lora-adapters  hash {adapter name: {"path": its folder}}  the LoRA
                            adapters the mesh serves (the gateways write and keep it;
                            EXPIRE 10 min after the last gateway stops)

An instance registers once and then heartbeats (refreshing the TTL and its load); one
that stops heartbeating drops out when its key expires, so a router never sees it
again. The prefix lets several meshes share one redis, which may want a password (in
the URL, or from PDMESH_REDIS_PASSWORD(_FILE)) and TLS (``rediss://``, with
``?ssl_ca_certs=PATH``). With a cluster secret
(shared/infra/cluster_auth.py) every entry carries ``sig``, an HMAC of what it routes
to, and an entry without a valid one is not listed: a forged entry is never routed to.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlparse

import redis

from pdmesh.shared.infra import cluster_auth

log = logging.getLogger(__name__)

# the LoRA adapters the mesh serves outlive its gateways by this much (a gateway that
# restarts within it finds the adapters loaded at runtime)
ADAPTERS_TTL_MS = 600_000

ROLES = ("prefill", "decode", "mixed", "kvstore", "gateway", "eplb")
LOAD_FIELDS = ("running", "waiting", "free_kv_blocks", "total_kv_blocks",
               "queued_prefill_tokens", "block_size", "placement_version",
               "expert_bytes_moved", "decode_step_us", "prefill_ns_per_token",
               "max_num_batched_tokens", "stalled_ms", "spec_draft_tokens",
               "spec_accepted_tokens", "max_model_len", "tier_host_blocks",
               "tier_host_capacity", "tier_host_hits", "tier_storage_hits", "tier_queries")


@dataclass
class Instance:
    id: str
    role: str
    address: str
    model: str = ""
    dp_size: int = 1
    dp_rank: int = 0
    group: str = ""  # a DP instance's ranks share it (the EPLB controller's group name)
    load: dict[str, int] = field(default_factory=dict)
    heartbeat: float = 0.0  # unix time of the last heartbeat
    draining: bool = False
    runner: str = "generate"  # an engine's: generate, or pooling (it serves embeddings)
    adapters: tuple[str, ...] = ()  # the LoRA adapters it holds in host memory


def redis_password() -> str | None:
    """Redis's password when the URL carries none: PDMESH_REDIS_PASSWORD, or the file
    PDMESH_REDIS_PASSWORD_FILE names (compose and the k8s manifests point it at the
    cluster secret, which redis itself requires) - out of every command line."""
    value = os.environ.get("PDMESH_REDIS_PASSWORD", "")
    path = os.environ.get("PDMESH_REDIS_PASSWORD_FILE", "")
    if not value and path:
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError as e:
            raise ValueError(f"PDMESH_REDIS_PASSWORD_FILE ({path}): cannot read: "
                             f"{e.strerror}") from None
    return value or None


class Registry:
    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "pdmesh",
                 ttl_s: float = 6.0):
        self.prefix = prefix
        self.ttl_ms = int(ttl_s * 1000)
        password = None if urlparse(url).password else redis_password()
        self._redis = redis.Redis.from_url(url, socket_timeout=3, socket_connect_timeout=3,
                                           decode_responses=True,
                                           **({"password": password} if password else {}))
        self._signing_key = cluster_auth.signing_key()

    def _key(self, instance_id: str) -> str:
        return f"{self.prefix}:instance:{instance_id}"

    def put(self, inst: Instance) -> None:
        """Register or heartbeat: write the instance and restart its TTL."""
        if inst.role not in ROLES:
            raise ValueError(f"role: must be one of {', '.join(ROLES)}, got {inst.role!r}")
        inst.heartbeat = time.time()
        mapping = {"role": inst.role, "address": inst.address, "model": inst.model,
                   "dp_size": inst.dp_size, "dp_rank": inst.dp_rank, "group": inst.group,
                   "heartbeat": inst.heartbeat,
                   "draining": int(inst.draining), "runner": inst.runner,
                   "adapters": json.dumps(list(inst.adapters)),
                   **{k: int(inst.load.get(k, 0)) for k in LOAD_FIELDS}}
        if self._signing_key is not None:
            mapping["sig"] = cluster_auth.sign(self._signing_key, inst.id, mapping)
        key = self._key(inst.id)
        pipe = self._redis.pipeline()
        pipe.hset(key, mapping=mapping)
        pipe.pexpire(key, self.ttl_ms)
        pipe.execute()

    def remove(self, instance_id: str) -> None:
        self._redis.delete(self._key(instance_id))

    def instances(self, role: str | None = None, model: str | None = None) -> list[Instance]:
        out = []
        pattern = self._key("*")
        keys = list(self._redis.scan_iter(match=pattern, count=500))
        if not keys:
            return out
        pipe = self._redis.pipeline()
        for k in keys:
            pipe.hgetall(k)
        for key, h in zip(keys, pipe.execute(), strict=True):
            if not h:  # expired between scan and read
                continue
            instance_id = key.rsplit(":", 1)[1]
            if self._signing_key is not None and not cluster_auth.verify(
                    self._signing_key, instance_id, h):
                cluster_auth.warn_unsigned(instance_id)
                continue
            inst = Instance(
                id=instance_id, role=h.get("role", ""), address=h.get("address", ""),
                model=h.get("model", ""), dp_size=int(h.get("dp_size", 1)),
                dp_rank=int(h.get("dp_rank", 0)), group=h.get("group", ""),
                load={k: int(h.get(k, 0)) for k in LOAD_FIELDS},
                heartbeat=float(h.get("heartbeat", 0)), draining=h.get("draining") == "1",
                runner=h.get("runner", "generate"),
                adapters=tuple(json.loads(h.get("adapters") or "[]")))
            if (role is None or inst.role == role) and (model is None or inst.model == model):
                out.append(inst)
        return sorted(out, key=lambda i: i.id)

    # -- the LoRA adapters the mesh serves (name -> folder), beside the instances -------
    def _adapters_key(self) -> str:
        return f"{self.prefix}:lora-adapters"

    def put_adapter(self, name: str, path: str) -> bool:
        """Serve an adapter; False when one of that name is already served."""
        value = {"path": path}
        if self._signing_key is not None:
            value["sig"] = cluster_auth.sign_value(self._signing_key, name, path)
        pipe = self._redis.pipeline()
        pipe.hsetnx(self._adapters_key(), name, json.dumps(value))
        pipe.pexpire(self._adapters_key(), ADAPTERS_TTL_MS)
        return bool(pipe.execute()[0])

    def remove_adapter(self, name: str) -> bool:
        """Stop serving an adapter; False when none of that name is served."""
        return bool(self._redis.hdel(self._adapters_key(), name))

    def adapters(self) -> dict[str, str]:
        """The adapters served: name -> folder (an unsigned entry is left out where
        entries are signed). Reading keeps the table: it lasts while a gateway of the
        mesh reads it, and ADAPTERS_TTL_MS after the last stops."""
        pipe = self._redis.pipeline()
        pipe.hgetall(self._adapters_key())
        pipe.pexpire(self._adapters_key(), ADAPTERS_TTL_MS)  # (a gateway reads: kept)
        out = {}
        for name, raw in pipe.execute()[0].items():
            try:
                value = json.loads(raw)
                path = str(value["path"])
            except (ValueError, KeyError, TypeError):
                log.warning("registry: a LoRA adapter entry %r is not readable", name)
                continue
            if self._signing_key is not None and not hmac.compare_digest(
                    str(value.get("sig", "")),
                    cluster_auth.sign_value(self._signing_key, name, path)):
                cluster_auth.warn_unsigned(f"lora-adapter:{name}")
                continue
            out[name] = path
        return out


class Heartbeat:
    """Keeps one instance registered from a background thread until ``stop``."""

    def __init__(self, registry: Registry, inst: Instance,
                 load: Callable[[], dict[str, int]] | None = None, every_s: float = 1.0,
                 adapters: Callable[[], list[str]] | None = None):
        self.registry = registry
        self.inst = inst
        self._load = load
        self._adapters = adapters
        self._every = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    @staticmethod
    def new_id(role: str) -> str:
        return f"{role}-{uuid.uuid4().hex[:10]}"

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def _beat(self) -> None:
        if self._load is not None:
            self.inst.load = self._load()
        if self._adapters is not None:
            self.inst.adapters = tuple(self._adapters())
        self.registry.put(self.inst)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self._beat()
            except redis.RedisError as e:  # keep serving; the next beat may get through
                log.warning("heartbeat to redis failed: %s", e)

    def mark_draining(self) -> None:
        """Publish ``draining`` now (not at the next beat): routers skip the instance."""
        self.inst.draining = True
        try:
            self._beat()
        except redis.RedisError as e:
            log.warning("marking %s draining failed: %s", self.inst.id, e)

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        self._thread.join(5)
        if deregister:
            try:
                self.registry.remove(self.inst.id)
            except redis.RedisError as e:
                log.warning("deregistering %s failed: %s", self.inst.id, e)
