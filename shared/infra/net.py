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


def tcp_sockets(pid: int) -> list[tuple[str, str, str]]:
    """(state, local, remote) of every TCP socket process ``pid`` holds, in its network
    namespace, as /proc/net/tcp{,6} write them (hex: "0A" is LISTEN, "01" ESTABLISHED;
    "0100007F:1F90"). OSError where /proc cannot tell (the process gone, another
    user's)."""
    fd_dir = f"/proc/{pid}/fd"
    inodes = set()
    for fd in os.listdir(fd_dir):
        try:
            link = os.readlink(f"{fd_dir}/{fd}")
        except FileNotFoundError:  # closed since the listing
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[9] in inodes:
                    out.append((cols[3], cols[1], cols[2]))
    return out


def listening_ports(pid: int) -> set[int] | None:
    """The TCP ports process ``pid`` listens on (its own sockets), or None where /proc
    cannot tell (not Linux, another user's process); empty once it is gone."""
    try:
        return {int(local.rsplit(":", 1)[1], 16)
                for state, local, _ in tcp_sockets(pid) if state == "0A"}
    except FileNotFoundError:
        return set() if os.path.exists("/proc/self/net/tcp") else None  # (pid gone)
    except OSError:
        return None
