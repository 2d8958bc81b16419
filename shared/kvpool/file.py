"""A KV pool in a directory (SGLang's HiCache ``file`` storage backend): one file per
block, named by its key, so the instances on one host share it and it outlives them.

    <root>/<fingerprint digest>/<block hash>[.<group>]
        header   magic "PDKV1\\0", the payload's length (8 bytes, little endian) and its
                 blake2b digest (16 bytes)
        payload  the block's value, as every pool holds it (base.py)

A file is written under a temporary name and renamed into place, so a reader sees a whole
block or none. A read checks the length and the digest: a truncated or altered file is a
miss (and removed), never a block served. A write that fails (the disk full, the
directory gone) is a block not stored, with a warning: the prompt is computed instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import struct
import threading
import uuid
from pathlib import Path

from pdmesh.shared.kvpool.base import KVPool, PoolStats, Region

log = logging.getLogger(__name__)

MAGIC = b"PDKV1\0"
HEADER = struct.Struct("<6sQ16s")  # magic, payload bytes, blake2b-16 of the payload


def _digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class FilePool(KVPool):
    def __init__(self, root: str | Path, capacity_bytes: int | None = None):
        """``capacity_bytes``: stop storing past this many bytes of this instance's
        writes (None: until the disk is full)."""
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--hicache-storage-backend file: cannot use {self.root}: "
                             f"{e.strerror}") from None
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        self._written = 0
        self._hits = self._misses = 0
        self.corrupt = 0  # blocks found truncated or altered (and removed)
        self.write_failures = 0
        self._warned: set[str] = set()

    def path(self, key: str) -> Path:
        """The file of ``key`` (``<fingerprint>/<hash>[/<group>]``)."""
        fingerprint, _, rest = key.partition("/")
        folder = hashlib.blake2b(fingerprint.encode(), digest_size=8).hexdigest()
        name = rest.replace("/", ".")
        if not name or any(c in name for c in "\\\0") or name.startswith("."):
            raise ValueError(f"key: {key!r} is not a pool key")
        return self.root / folder / name

    def exists(self, keys: list[str]) -> list[bool]:
        found = [self.path(k).is_file() for k in keys]
        with self._lock:
            self._hits += sum(found)
            self._misses += len(found) - sum(found)
        return found

    def put(self, keys: list[str], regions: list[list[Region]]) -> list[bool]:
        return [self._put_one(k, regs) for k, regs in zip(keys, regions, strict=True)]

    def _put_one(self, key: str, regs: list[Region]) -> bool:
        path = self.path(key)
        if path.is_file():
            return True
        size = sum(n for _, n in regs)
        with self._lock:
            full = self._capacity is not None and self._written + size > self._capacity
        if full:
            self._warn("full", f"file store {self.root}: its {self._capacity} bytes are "
                               "used; blocks past them are not stored")
            return False
        payload = b"".join(ctypes.string_at(addr, n) for addr, n in regs)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(HEADER.pack(MAGIC, size, _digest(payload)))
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # (the folder itself is what failed)
            with self._lock:
                self.write_failures += 1
            self._warn(f"write{e.errno}", f"file store {self.root}: a write failed "
                                          f"({e.strerror}); blocks are not stored")
            return False
        with self._lock:
            self._written += size
        return True

    def get(self, keys: list[str], regions: list[list[Region]]) -> list[bool]:
        out = [self._get_one(k, regs) for k, regs in zip(keys, regions, strict=True)]
        with self._lock:
            self._hits += sum(out)
            self._misses += len(out) - sum(out)
        return out

    def _get_one(self, key: str, regs: list[Region]) -> bool:
        path = self.path(key)
        size = sum(n for _, n in regs)
        data = bytearray(HEADER.size + size + 1)  # (one byte more: a longer file shows)
        try:
            with open(path, "rb") as f:
                got = f.readinto(data)
        except OSError:
            return False
        payload = memoryview(data)[HEADER.size:HEADER.size + size]
        magic, length, digest = HEADER.unpack_from(data)
        if got != HEADER.size + size or (magic, length) != (MAGIC, size) \
                or digest != _digest(payload):
            with self._lock:
                self.corrupt += 1
            log.warning("file store: %s is truncated or altered; removed (the block is "
                        "computed again)", path)
            path.unlink(missing_ok=True)
            return False
        base = ctypes.addressof(ctypes.c_char.from_buffer(data)) + HEADER.size
        for addr, n in regs:
            ctypes.memmove(addr, base, n)
            base += n
        return True

    def clear(self) -> int:
        n = 0
        for folder in self.root.iterdir():
            if folder.is_dir():
                for f in folder.iterdir():
                    f.unlink(missing_ok=True)
                    n += 1
        with self._lock:
            self._written = 0
        return n

    def stats(self) -> PoolStats:
        keys = size = 0
        for folder in self.root.iterdir():
            if folder.is_dir():
                for f in folder.iterdir():
                    if not f.name.startswith("."):
                        keys += 1
                        size += max(0, f.stat().st_size - HEADER.size)
        with self._lock:
            return PoolStats(keys, size, self._hits, self._misses)

    def _warn(self, what: str, message: str) -> None:
        """``message`` once per kind of failure (they repeat on every write)."""
        with self._lock:
            if what in self._warned:
                return
            self._warned.add(what)
        log.warning(message)
