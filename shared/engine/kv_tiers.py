"""KV cache tiers under the prefix cache (SGLang's HiCache, vLLM's KV offloading).

    L1  the engine's blocks (block_manager.py): what the steps read
    L2  ``HostTier``: blocks in host memory by pool key, least recently used dropped
        first, filled as --hicache-write-policy says:
            write_back               a block evicted from L1, as its content goes
            write_through            every full block, once a step has computed it
            write_through_selective  a block once L1's prefix cache has hit it twice
    L3  storage (--hicache-storage-backend): a ``KVPool`` - the file store (a directory the
        instances on one host share, kept across restarts) or the Mooncake pool. Every
        block L2 takes is written there too, on a thread beside the steps.

A waiting request's prompt past its L1 hits is read back from L2 (and from L3, through
L2) into its blocks before it runs, beside the steps (the scheduler's pool loads:
``TierConnector``); past what the tiers hold, from the mesh's KV pool where there is
one. Keys are the pool's (kv_connector.py): the model's fingerprint (its content, cache
layout, KV dtype, block size) and the chained block hash (a LoRA adapter in its root), a
group's name after every group's but the first: any instance finds any block.

L1 and L2 move whole blocks with torch copies (``index_select`` / ``index_copy_``), so the
tiers are the same on cpu, cuda and npu; L2's tensors are pinned on a device, and
L3 reads and writes L2's memory (host addresses, as every pool takes them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pdmesh.shared.kvpool.base import CacheRegions, KVPool, keep_time

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
SELECTIVE_HITS = 2  # write_through_selective: the L1 hits that earn a block its copy
STORAGE_BACKENDS = ("file", "mooncake")

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
Block = tuple[int, int]  # (cache group, block id)


@dataclass(frozen=True)
class TierConfig:
    """The tiers an engine keeps (EngineConfig.kv_tiers; shared/config/tier_flags.py
    reads SGLang's and vLLM's flags into it)."""

    host_bytes: int | None = None  # L2's host memory (--hicache-size, --kv-offloading-size)
    host_ratio: float = 2.0  # else L2 is this many times L1's bytes (--hicache-ratio)
    write_policy: str = "write_through"
    storage: str | None = None  # L3: "file" or "mooncake" (None: none)
    storage_dir: str = "/tmp/hicache"  # the file store's directory
    # a read from the tiers still running after --kv-load-timeout is given up (the prompt
    # computed) under best_effort and timeout; wait_complete waits for it
    prefetch_policy: str = "best_effort"

    def validate(self) -> None:
        """ValueError naming the flag of the first bad field."""
        if self.host_bytes is not None and self.host_bytes <= 0:
            raise ValueError(f"--hicache-size: must be > 0, got {self.host_bytes} bytes")
        if not self.host_ratio > 0:
            raise ValueError(f"--hicache-ratio: must be > 0, got {self.host_ratio}")
        for flag, value, choices in (
                ("--hicache-write-policy", self.write_policy, WRITE_POLICIES),
                ("--hicache-storage-prefetch-policy", self.prefetch_policy,
                 PREFETCH_POLICIES)):
            if value not in choices:
                raise ValueError(f"{flag}: must be one of {', '.join(choices)}, got {value!r}")
        if self.storage is not None and self.storage not in STORAGE_BACKENDS:
            raise ValueError(f"--hicache-storage-backend: pdmesh stores blocks in "
                             f"{' or '.join(STORAGE_BACKENDS)}, not {self.storage!r}")

    def capacity(self, l1_bytes: int) -> int:
        """L2's bytes, for an L1 of ``l1_bytes``."""
        return self.host_bytes if self.host_bytes is not None else int(l1_bytes * self.host_ratio)


@dataclass
class TierStats:
    """Since start: per tier, blocks found and asked for; bytes moved each way; the copy
    times (seconds of each batch, taken by the metrics collector)."""

    hits: dict[str, int] = field(default_factory=lambda: {"host": 0, "storage": 0})
    queries: int = 0
    bytes: dict[str, int] = field(default_factory=lambda: {
        "to_host": 0, "from_host": 0, "to_storage": 0, "from_storage": 0})
    seconds: dict[str, list[float]] = field(default_factory=lambda: {
        "to_host": [], "from_host": [], "to_storage": [], "from_storage": []})

    def take_seconds(self, direction: str) -> list[float]:
        """The copy times since the last call (the metrics collector's)."""
        taken, self.seconds[direction] = self.seconds[direction], []
        return taken

    def timed(self, direction: str, nbytes: int, seconds: float) -> None:
        self.bytes[direction] += nbytes
        keep_time(self.seconds[direction], seconds)


class _GroupStore:
    """One cache group's L2: host tensors shaped as the group's cache tensors, ``slots``
    blocks each; which key each slot holds, least recently used first."""

    def __init__(self, tensors: list[torch.Tensor], slots: int, pin: bool):
        self.cache = tensors
        self.host = [torch.empty((slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                     for t in tensors]
        self.regions = CacheRegions(self.host)  # (L3 reads and writes these)
        self.block_bytes = self.regions.value_bytes
        self.free = list(range(slots - 1, -1, -1))
        self.slot_of: OrderedDict[str, int] = OrderedDict()
        self.busy: dict[int, int] = {}  # slot -> copies reading or writing it

    def take_slot(self) -> int | None:
        """A slot to fill: a free one, else the least recently used one no copy holds
        (its key forgotten); None when every slot is busy."""
        if self.free:
            return self.free.pop()
        for key, slot in self.slot_of.items():
            if slot not in self.busy:
                del self.slot_of[key]
                return slot
        return None

    def publish(self, key: str, slot: int) -> bool:
        """``slot`` now holds ``key`` - unless another slot came to hold it meanwhile (a
        read and a write of one block at once): False, and the caller frees ``slot``
        once its copy is done (``spare``)."""
        if key in self.slot_of:
            return False
        self.slot_of[key] = slot
        return True

    def spare(self, slots: list[int]) -> None:
        """Slots whose copies are done and that hold no key: free again."""
        for s in slots:
            if s not in self.busy:
                self.free.append(s)

    def hold(self, slots: list[int]) -> None:
        for s in slots:
            self.busy[s] = self.busy.get(s, 0) + 1

    def release(self, slots: list[int]) -> None:
        for s in slots:
            if self.busy[s] == 1:
                del self.busy[s]
            else:
                self.busy[s] -= 1

    def to_host(self, ids: list[int], slots: list[int]) -> None:
        """L1 blocks ``ids`` into L2 slots ``slots``."""
        dev = self.cache[0].device
        src, dst = torch.tensor(ids, device=dev), torch.tensor(slots)
        for c, h in zip(self.cache, self.host, strict=True):
            h.index_copy_(0, dst, c.index_select(0, src).to("cpu"))

    def from_host(self, slots: list[int], ids: list[int]) -> None:
        """L2 slots ``slots`` into L1 blocks ``ids``."""
        dev = self.cache[0].device
        src, dst = torch.tensor(slots), torch.tensor(ids, device=dev)
        for c, h in zip(self.cache, self.host, strict=True):
            c.index_copy_(0, dst, h.index_select(0, src).to(dev, non_blocking=True))
        if dev.type != "cpu":  # (the request runs once this returns: its blocks are in)
            torch.accelerator.synchronize(dev)


class HostTier:
    """L2 over every cache group of an engine (and L3 under it, if given)."""

    def __init__(self, groups: list[list[torch.Tensor]], capacity_bytes: int,
                 storage: KVPool | None = None):
        """``groups``: each cache group's tensors ([blocks, ...], as CacheRegions takes
        them); ``capacity_bytes``: L2's host memory. Every group gets as many slots: a
        token block's entry in each (DeepSeek-V4's compressed history and its window)."""
        block = sum(t[0].numel() * t.element_size() for ts in groups for t in ts)
        slots = capacity_bytes // block
        if slots < 1:
            raise ValueError(f"--hicache-size: {capacity_bytes} bytes of host memory do "
                             f"not hold one block ({block} bytes)")
        pin = groups[0][0].device.type != "cpu"
        self.stores = [_GroupStore(ts, slots, pin) for ts in groups]
        self.storage = storage
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-write") \
            if storage is not None else None
        if storage is not None:
            for s in self.stores:
                for t in s.host:
                    storage.register(t)

    @property
    def capacity_blocks(self) -> list[int]:
        return [len(s.host[0]) for s in self.stores]

    def occupancy(self) -> list[int]:
        """Per group, the L2 slots holding a block."""
        with self._lock:
            return [len(s.slot_of) for s in self.stores]

    def holds(self, keys: list[str], groups: list[int]) -> list[bool]:
        """Which keys L2 holds, or else L3 (each key of its cache group)."""
        with self._lock:
            found = [k in self.stores[g].slot_of for k, g in zip(keys, groups, strict=True)]
        missing = [i for i, f in enumerate(found) if not f]
        if missing and self.storage is not None:
            try:
                there = self.storage.exists([keys[i] for i in missing])
            except (OSError, ConnectionError) as e:
                log.warning("kv tiers: storage lookup failed (%s)", e)
                there = [False] * len(missing)
            for i, f in zip(missing, there, strict=True):
                found[i] = f
        return found

    def put(self, keys: list[str], blocks: list[Block]) -> int:
        """Copy L1 blocks into L2 under their keys (those it holds already are only
        marked recently used); each new one is written to L3 beside the steps. Returns
        the blocks copied."""
        by_group: dict[int, tuple[list[str], list[int], list[int]]] = {}
        with self._lock:
            for key, (g, block_id) in zip(keys, blocks, strict=True):
                store = self.stores[g]
                if key in store.slot_of:
                    store.slot_of.move_to_end(key)
                    continue
                slot = store.take_slot()
                if slot is None:
                    continue  # (every slot is being copied: this block is not kept)
                store.hold([slot])
                entry = by_group.setdefault(g, ([], [], []))
                entry[0].append(key)
                entry[1].append(block_id)
                entry[2].append(slot)
        copied = 0
        for g, (gkeys, ids, slots) in by_group.items():
            store = self.stores[g]
            t0 = time.perf_counter()
            store.to_host(ids, slots)
            self.stats.timed("to_host", len(ids) * store.block_bytes, time.perf_counter() - t0)
            with self._lock:
                kept = [store.publish(k, sl) for k, sl in zip(gkeys, slots, strict=True)]
                if self._writer is None or not all(kept):
                    store.release([sl for sl, k in zip(slots, kept, strict=True)
                                   if self._writer is None or not k])
                    store.spare([sl for sl, k in zip(slots, kept, strict=True) if not k])
                gkeys = [k for k, ok in zip(gkeys, kept, strict=True) if ok]
                slots = [sl for sl, ok in zip(slots, kept, strict=True) if ok]
            if self._writer is not None and gkeys:  # (the slots stay held until written)
                self._writer.submit(self._write_storage, g, gkeys, slots)
            copied += len(ids)
        return copied

    def _write_storage(self, g: int, keys: list[str], slots: list[int]) -> None:
        store = self.stores[g]
        try:
            t0 = time.perf_counter()
            done = self.storage.put(keys, [store.regions.regions(s) for s in slots])
            self.stats.timed("to_storage", sum(done) * store.block_bytes,
                             time.perf_counter() - t0)
        except (OSError, ConnectionError) as e:
            log.warning("kv tiers: storage write failed (%s); blocks kept in host memory "
                        "only", e)
        except Exception:  # noqa: BLE001 (a writer thread must not die silently)
            log.exception("kv tiers: storage write failed")
        finally:
            with self._lock:
                store.release(slots)

    def get(self, keys: list[str], blocks: list[Block]) -> list[bool]:
        """Copy each key's block into its L1 block: from L2, or from L3 through L2.
        Returns per key whether it was found (a missing key's block is left as is)."""
        found = [False] * len(keys)
        plan: dict[int, tuple[list[int], list[int], list[int]]] = {}  # g -> (i, ids, slots)
        with self._lock:
            self.stats.queries += len(keys)
            for i, (key, (g, block_id)) in enumerate(zip(keys, blocks, strict=True)):
                slot = self.stores[g].slot_of.get(key)
                if slot is not None:
                    self.stores[g].slot_of.move_to_end(key)
                    self.stores[g].hold([slot])
                    entry = plan.setdefault(g, ([], [], []))
                    entry[0].append(i), entry[1].append(block_id), entry[2].append(slot)
            self.stats.hits["host"] += sum(len(e[0]) for e in plan.values())
        in_host = {i for e in plan.values() for i in e[0]}
        missing = [i for i in range(len(keys)) if i not in in_host]
        spares: set[tuple[int, int]] = set()  # (group, slot): read, but not kept
        if missing and self.storage is not None:
            spares = self._read_storage(keys, blocks, missing, plan)
        for g, (idx, ids, slots) in plan.items():
            store = self.stores[g]
            t0 = time.perf_counter()
            try:
                store.from_host(slots, ids)
            finally:
                with self._lock:
                    store.release(slots)
                    store.spare([sl for sl in slots if (g, sl) in spares])
            self.stats.timed("from_host", len(ids) * store.block_bytes,
                             time.perf_counter() - t0)
            for i in idx:
                found[i] = True
        return found

    def _read_storage(self, keys: list[str], blocks: list[Block], missing: list[int],
                      plan: dict[int, tuple[list[int], list[int], list[int]]]
                      ) -> set[tuple[int, int]]:
        """Read ``missing`` keys from L3 into free L2 slots (held), adding those found to
        ``plan``; returns the (group, slot)s to free once copied (their key came to
        another slot meanwhile)."""
        spares: set[tuple[int, int]] = set()
        taken: list[tuple[int, int]] = []  # (i, slot)
        with self._lock:
            for i in missing:
                slot = self.stores[blocks[i][0]].take_slot()
                if slot is not None:
                    self.stores[blocks[i][0]].hold([slot])
                    taken.append((i, slot))
        try:
            t0 = time.perf_counter()
            ok = self.storage.get([keys[i] for i, _ in taken],
                                  [self.stores[blocks[i][0]].regions.regions(s)
                                   for i, s in taken])
        except (OSError, ConnectionError) as e:
            log.warning("kv tiers: storage read failed (%s); computing instead", e)
            ok = [False] * len(taken)
        nbytes = sum(self.stores[blocks[i][0]].block_bytes
                     for (i, _), f in zip(taken, ok, strict=True) if f)
        self.stats.timed("from_storage", nbytes, time.perf_counter() - t0)
        with self._lock:
            for (i, slot), f in zip(taken, ok, strict=True):
                g, block_id = blocks[i]
                store = self.stores[g]
                if not f:
                    store.release([slot])
                    store.free.append(slot)
                    continue
                self.stats.hits["storage"] += 1
                if not store.publish(keys[i], slot):
                    spares.add((g, slot))
                entry = plan.setdefault(g, ([], [], []))
                entry[0].append(i), entry[1].append(block_id), entry[2].append(slot)
        return spares

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the L3 writes queued so far (tests; a drained engine)."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result(timeout)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None


Keyer = Callable[[int, bytes], str]  # (group, block hash) -> the pool key
