"""The Mooncake Store backend: KV blocks live in a Mooncake cluster.

``mooncake_master`` (run and supervised by the kvstore service, with its built-in HTTP
metadata server) keeps the directory; every client also contributes a memory segment
that holds values. Transfers go over TCP here and RDMA / Ascend transports in
production, straight between registered memory: ``batch_put_from_multi_buffers`` reads a
block from the paged cache's own tensors and ``batch_get_into_multi_buffers`` writes
into them, so no block is ever copied through Python.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import urllib.parse
from typing import TYPE_CHECKING

from pdmesh.shared.infra.bindhost import is_address
from pdmesh.shared.kvpool.base import KVPool, PoolStats, Region

if TYPE_CHECKING:  # (the kvstore serves the pool without torch)
    import torch

log = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 512 << 20  # memory this client lends to the pool
DEFAULT_LOCAL_BUFFER_BYTES = 64 << 20
PROBE_INTERVAL_S = 0.2  # how long a master liveness probe is trusted
PROBE_TIMEOUT_S = 0.3
# keys per native batch call, one call in flight per client: Mooncake's TCP transport
# refuses transfers past its per-peer queue ("TCP lane queue-full rejection"), and the
# keys still waiting see their read leases expire, so a prompt of hundreds of blocks read
# in one call (or several such reads at once) came back with none of them
BATCH_KEYS = 64


class PoolUnavailable(ConnectionError):
    """The Mooncake master (or a peer segment) could not be reached."""


class MooncakePool(KVPool):
    def __init__(self, master_address: str, metadata_url: str, *,
                 local_hostname: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "", segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 local_buffer_bytes: int = DEFAULT_LOCAL_BUFFER_BYTES):
        from mooncake.store import MooncakeDistributedStore  # needs libibverbs1

        self.master_address = master_address
        self.metadata_url = metadata_url
        _preflight(master_address, metadata_url)
        if is_address(local_hostname):  # Mooncake advertises this address to its peers,
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)  # not eth0's

        self._store = MooncakeDistributedStore()
        rc = self._store.setup(local_hostname, metadata_url, segment_bytes, local_buffer_bytes,
                               protocol, device_name, master_address)
        if rc != 0:
            raise PoolUnavailable(f"kv pool: cannot join the Mooncake master at "
                                  f"{master_address} (metadata {metadata_url}): "
                                  f"setup returned {rc}")
        self._registered: set[int] = set()
        self._transfer_lock = threading.Lock()  # (see BATCH_KEYS)
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._probe_at = 0.0
        self._probe_ok = True

    def register(self, tensor: torch.Tensor) -> None:
        ptr = tensor.data_ptr()
        if ptr in self._registered:
            return
        rc = self._store.register_buffer(ptr, tensor.numel() * tensor.element_size())
        if rc != 0:
            raise PoolUnavailable(f"kv pool: register_buffer failed with {rc}")
        self._registered.add(ptr)

    def master_alive(self) -> bool:
        """Whether the master accepts connections (a probe trusted for half a second)."""
        now = time.monotonic()
        if now - self._probe_at > PROBE_INTERVAL_S:
            host, _, port = self.master_address.rpartition(":")
            try:
                with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
                    self._probe_ok = True
            except OSError:
                self._probe_ok = False
            self._probe_at = now
        return self._probe_ok

    def _require_master(self) -> None:
        """Fail fast while the master is down. Mooncake's client would otherwise retry
        inside each call for a long time, and a caller (an engine step) would hang."""
        if self._store is None:
            raise PoolUnavailable("kv pool: this client is closed")
        if not self.master_alive():
            raise PoolUnavailable(f"kv pool: the Mooncake master at {self.master_address} "
                                  "is down")

    def exists(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        self._require_master()
        codes = self._store.batch_is_exist(keys)  # 1 found, 0 not, -1 error
        if any(c < 0 for c in codes):
            self._probe_at = 0.0  # the next call asks whether the master is there
            raise PoolUnavailable(f"kv pool: lookup failed at the master {self.master_address}")
        found = [c == 1 for c in codes]
        with self._lock:
            self._hits += sum(found)
            self._misses += len(found) - sum(found)
        return found

    def put(self, keys: list[str], regions: list[list[Region]]) -> list[bool]:
        if not keys:
            return []
        present = self.exists(keys)  # checks the master too
        todo = [i for i, p in enumerate(present) if not p]
        result = list(present)
        if todo:
            codes = self._batched(self._store.batch_put_from_multi_buffers,
                                  [keys[i] for i in todo], [regions[i] for i in todo])
            for i, code in zip(todo, codes, strict=True):
                result[i] = code == 0
                if code != 0:
                    log.warning("kv pool: put %s failed with %d", keys[i], code)
            if any(c < 0 for c in codes):
                self._probe_at = 0.0
        return result

    def get(self, keys: list[str], regions: list[list[Region]]) -> list[bool]:
        if not keys:
            return []
        self._require_master()
        codes = self._batched(self._store.batch_get_into_multi_buffers, keys, regions)
        ok = [code == sum(n for _, n in regs) for code, regs in zip(codes, regions, strict=True)]
        if any(c < 0 for c in codes):
            self._probe_at = 0.0
        with self._lock:
            self._hits += sum(ok)
            self._misses += len(ok) - sum(ok)
        return ok

    def _batched(self, call, keys: list[str], regions: list[list[Region]]) -> list[int]:
        """``call`` (a batch put or get) over ``BATCH_KEYS`` keys at a time, one call of
        this client's in flight; the codes of all of them, in order."""
        codes: list[int] = []
        for lo in range(0, len(keys), BATCH_KEYS):
            part = regions[lo:lo + BATCH_KEYS]
            with self._transfer_lock:
                codes += call(keys[lo:lo + BATCH_KEYS], [[a for a, _ in r] for r in part],
                              [[n for _, n in r] for r in part])
        return codes

    def clear(self) -> int:
        self._require_master()
        return max(0, int(self._store.remove_all(True)))

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(keys=-1, bytes=-1, hits=self._hits, misses=self._misses)

    def close(self) -> None:
        if self._store is None:
            return
        for ptr in self._registered:
            self._store.unregister_buffer(ptr)
        self._registered.clear()
        self._probe_at = 0.0  # ask now
        store, self._store = self._store, None
        if self.master_alive():
            store.close()
        else:
            _abandon(store)


_abandoned: list[object] = []  # clients kept by _abandon


def _abandon(store) -> None:
    """Keep a client whose master is gone for the life of the process. Closing it - or
    letting it be destroyed, even at exit - retries the unmount at the dead master for
    ~20 s with the GIL held: the whole process stops (heartbeats, steps, streams). Kept,
    it costs its threads and local buffer (~60 MB) and a log line every few seconds; the
    process ends past Mooncake's teardown (``exit_past_abandoned``)."""
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(store))  # never destroyed by Python
    _abandoned.append(store)
    log.warning("kv pool: a client of a Mooncake master that is gone is kept (closing it "
                "would stop this process for ~20 s)")


def exit_past_abandoned(code: int) -> None:
    """End the process now, with ``code``, if it kept a client of a gone master: the
    mooncake library's own teardown at exit cleans every client up, that one too, and
    waits ~10-20 s on the dead master. Done after the process's own shutdown (pool
    closed, registry left); only logs are flushed."""
    if _abandoned:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _preflight(master_address: str, metadata_url: str, timeout_s: float = 3.0) -> None:
    """Fail fast and clearly when nothing listens: Mooncake's own setup retries for
    about a minute and a half before giving up."""
    host, _, port = master_address.rpartition(":")
    meta = urllib.parse.urlsplit(metadata_url)
    for what, addr in (("master", (host, int(port))),
                       ("metadata server", (meta.hostname or "", meta.port or 80))):
        try:
            with socket.create_connection(addr, timeout=timeout_s):
                pass
        except OSError as e:
            raise PoolUnavailable(f"kv pool: the Mooncake {what} at {addr[0]}:{addr[1]} is "
                                  f"unreachable ({e.strerror or e})") from e
