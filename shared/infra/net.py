"""Addresses and ports on the host a service is given."""

from __future__ import annotations

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
