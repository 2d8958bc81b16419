"""Loopback means loopback: native libraries bind the host a service is given.

pdmesh's own listeners bind exactly ``--host``. Three libraries would not: Mooncake's
transfer engine listens on the wildcard address and advertises the first non-loopback
interface it finds ("Found active interface eth0 ..."), so KV went to eth0 even under
`pdmesh up`; its master's HTTP metadata server ignores the host it is told; torch's
TCPStore listens on all interfaces and gloo picks an interface from the hostname. So a
process that runs them (kvstore, prefill, decode, mixed) with a concrete ``--host``:

  - runs with ``bindhost.c`` preloaded (built with the package as
    ``pdmesh.shared.infra._bindhost``): a wildcard bind() binds the host instead;
    ``ensure_bound`` re-executes the process with it at start-up (same pid);
  - tells Mooncake the address to advertise (``MC_TCP_BIND_ADDRESS``) and gloo the
    interface that has it (``GLOO_SOCKET_IFNAME``), unless the user set them.

``--host 0.0.0.0`` (containers) changes nothing: every interface was asked for.
"""

from __future__ import annotations

import fcntl
import importlib.util
import ipaddress
import logging
import os
import socket
import struct
import sys

from pdmesh.shared.infra.net import WILDCARDS

log = logging.getLogger(__name__)

SHIM_MODULE = "pdmesh.shared.infra._bindhost"
HOST_VAR = "PDMESH_BIND_HOST"
_SIOCGIFADDR = 0x8915


def shim_path() -> str | None:
    """The built bind shim, or None (built without a C compiler)."""
    spec = importlib.util.find_spec(SHIM_MODULE)
    return spec.origin if spec is not None and spec.origin else None


def is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def bound_env(host: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with what makes native libraries bind ``host``;
    unchanged for a wildcard or a host name."""
    env = dict(os.environ if env is None else env)
    if host in WILDCARDS or not is_address(host):
        return env
    shim = shim_path()
    if shim is not None:
        preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != shim]
        env["LD_PRELOAD"] = ":".join([shim, *preload])
        env[HOST_VAR] = host
    env.setdefault("MC_TCP_BIND_ADDRESS", host)
    ifname = interface_of(host)
    if ifname is not None:
        env.setdefault("GLOO_SOCKET_IFNAME", ifname)
    return env


def ensure_bound(host: str, argv: list[str] | None = None) -> None:
    """Re-execute this process (``python -m pdmesh`` with ``argv``, default the same
    arguments; the same pid) with ``bound_env(host)``, unless it runs with it already.
    Returns only when nothing had to change."""
    env = bound_env(host)
    if env == dict(os.environ):
        return
    if HOST_VAR in env and os.environ.get(HOST_VAR) != host:
        sys.stdout.flush()
        sys.stderr.flush()
        args = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, "-m", "pdmesh", *args], env)
    os.environ.update(env)  # no shim to preload: the variables still help
    if shim_path() is None and host not in WILDCARDS and is_address(host):
        log.warning("built without the bind shim (no C compiler at install): Mooncake's "
                    "transfer ports and torch's store listen on every interface, not only "
                    "%s", host)


def interface_of(address: str) -> str | None:
    """The network interface that has ``address`` (IPv4), e.g. "lo" for 127.0.0.1."""
    try:
        want = socket.inet_aton(address)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if got[20:24] == want:
                return name
    return "lo" if address.startswith("127.") else None
