"""The registry on a redis that wants a password (in the URL, or from
PDMESH_REDIS_PASSWORD_FILE) and on one that speaks only TLS (``rediss://``): real
redis-servers on loopback, free ports, stopped by process id."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

from pdmesh.shared.infra.registry import Instance, Registry

PASSWORD = "registry-pw-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis(tmp: Path, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp), *args],
                            stdout=open(tmp / "redis.log", "wb"),  # noqa: SIM115
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while b"Ready to accept connections" not in (tmp / "redis.log").read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, \
            (tmp / "redis.log").read_text()
        time.sleep(0.05)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _round_trip(registry: Registry) -> None:
    inst = Instance("decode-x", "decode", "127.0.0.1:1", model="m")
    registry.put(inst)
    assert [i.id for i in registry.instances("decode")] == ["decode-x"]
    registry.remove("decode-x")
    assert registry.instances() == []


def test_a_password_from_the_url_or_a_file(tmp_path, monkeypatch):
    port = _free_port()
    proc = _redis(tmp_path, "--port", str(port), "--requirepass", PASSWORD)
    try:
        monkeypatch.delenv("PDMESH_REDIS_PASSWORD", raising=False)
        monkeypatch.delenv("PDMESH_REDIS_PASSWORD_FILE", raising=False)
        with pytest.raises(redis.AuthenticationError):
            Registry(f"redis://127.0.0.1:{port}/0", "t").instances()
        _round_trip(Registry(f"redis://:{PASSWORD}@127.0.0.1:{port}/0", "t"))
        secret = tmp_path / "pw"
        secret.write_text(PASSWORD + "\n")
        monkeypatch.setenv("PDMESH_REDIS_PASSWORD_FILE", str(secret))
        _round_trip(Registry(f"redis://127.0.0.1:{port}/0", "t"))  # nothing in the URL
    finally:
        _stop(proc)


def test_tls_only(tmp_path, monkeypatch):
    monkeypatch.delenv("PDMESH_REDIS_PASSWORD", raising=False)
    monkeypatch.delenv("PDMESH_REDIS_PASSWORD_FILE", raising=False)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.crt", "-days", "1", "-subj", "/CN=pdmesh-test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
            "server.csr", "-subj", "/CN=127.0.0.1")
    (tmp_path / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "ext")
    port = _free_port()
    proc = _redis(tmp_path, "--port", "0", "--tls-port", str(port),
                  "--tls-cert-file", "server.crt", "--tls-key-file", "server.key",
                  "--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no",
                  "--requirepass", PASSWORD)
    try:
        with pytest.raises(redis.ConnectionError):  # plain text to a TLS port
            Registry(f"redis://:{PASSWORD}@127.0.0.1:{port}/0", "t").instances()
        ca = tmp_path / "ca.crt"
        _round_trip(Registry(f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={ca}",
                             "t"))
    finally:
        _stop(proc)
