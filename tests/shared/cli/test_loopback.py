"""Loopback means loopback: after `pdmesh up` on 127.0.0.1, serving requests, no socket of
the mesh listens beyond 127.0.0.1 and no connection goes to any other address - Mooncake's
master and transfer engine, torch's process group and the gRPC edges included."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import httpx
import pytest

from pdmesh.shared.infra.net import tcp_sockets
from tests.shared.cli.test_up import launch, shut

TCP_STATES = {"01": "ESTABLISHED", "0A": "LISTEN"}


def tree(root: int) -> set[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(proc.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def _address(hex_addr: str) -> str:
    ip, _, port = hex_addr.partition(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return f"{ipaddress.IPv4Address(raw[::-1])}:{int(port, 16)}"
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return f"[{ipaddress.IPv6Address(words)}]:{int(port, 16)}"


def sockets(pids: set[int]) -> list[tuple[int, str, str, str]]:
    """(pid, state, local, remote) of every TCP socket the processes hold."""
    out = []
    for pid in pids:
        try:
            held = tcp_sockets(pid)
        except OSError:  # it exited meanwhile
            continue
        out += [(pid, TCP_STATES[state], _address(local), _address(remote))
                for state, local, remote in held if state in TCP_STATES]
    return out


def loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    ip = ipaddress.ip_address(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def not_loopback(pids: set[int]) -> list[tuple[int, str, str, str]]:
    return [s for s in sockets(pids) if not loopback(s[2])
            or (s[1] == "ESTABLISHED" and not loopback(s[3]))]


def command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


@pytest.mark.parametrize("moe", [False, True], ids=["pd", "moe-dp2-ep"])
def test_up_keeps_every_socket_on_loopback(tiny_models, tmp_path, registry_prefix, moe):
    model = tiny_models["qwen3_moe" if moe else "qwen3"]
    prefix = f"{registry_prefix}-lo-{int(moe)}"
    extra = ["--decode-args", "--data-parallel-size 2 --enable-expert-parallel"] if moe else []
    proc, url, out = launch("up", str(model), "--port", "0", "--registry-prefix", prefix,
                            "--log-dir", str(tmp_path), "--engine-args",
                            "--device cpu --block-size 16 --pool-segment-mb 64", *extra)
    try:
        assert url, "".join(out)
        mesh = tree(proc.pid)
        assert len(mesh) >= 7, [command_of(p) for p in mesh]  # up, kvstore, master, ...
        offenders: list = []
        for i in range(6):  # requests move KV through the pool meanwhile
            r = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": str(model), "prompt": list(range(40 + i, 140 + i)),
                "max_tokens": 8, "ignore_eos": True})
            assert r.status_code == 200, r.text
            offenders += not_loopback(tree(proc.pid))
        seen = sockets(tree(proc.pid))
        assert any(s[1] == "LISTEN" for s in seen) and any(s[1] == "ESTABLISHED" for s in seen)
        assert offenders == [], [(command_of(p), *rest) for p, *rest in offenders]
        logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
        assert "Found active interface" not in logs
    finally:
        shut(proc, prefix)
