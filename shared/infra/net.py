"""Addresses and ports on the host a service is given."""

from __future__ import annotations

import os
import socket

WILDCARDS = ("0.0.0.0", "::", "")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` now (the kernel's pick)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def reachable_host(bind_host: str) -> str:
    """Where this machine's own processes reach a service bound at ``bind_host``."""
    return "127.0.0.1" if bind_host in WILDCARDS else bind_host


def listening_ports(pid: int) -> set[int] | None:
    """The TCP ports process ``pid`` listens on (its own sockets, in its network
    namespace), or None where /proc cannot tell (not Linux, another user's process)."""
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        ports = set()
        for table in ("tcp", "tcp6"):
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        return ports
    except FileNotFoundError:
        return set() if os.path.exists("/proc/self/net/tcp") else None  # (pid gone)
    except (PermissionError, StopIteration, IndexError, ValueError):
        return None
