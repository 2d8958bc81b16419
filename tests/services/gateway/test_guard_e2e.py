"""The gateway against slow, huge and nosy clients, as a real process on loopback (no
engines registered: a request that gets past the gateway's own checks is answered 503,
which is how these tests tell "past the guard" from "held by it"):

- a client that sends half a body and stalls holds a connection, not a
  --max-queued-requests slot, and gets a 408 after --request-body-timeout;
- a body over --max-request-body-bytes is a 413, told by Content-Length or counted while
  it is read, before it is parsed;
- a big body is parsed and tokenized off the event loop: the gateway answers meanwhile;
- with an API key (here from --api-key-file) every path but /health needs it.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from pdmesh.shared.infra.launcher import Service

KEY = "guard-key"
LIMIT = 1_000_000
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def gateway(qwen3_path, tmp_path_factory, registry_prefix):
    logs = tmp_path_factory.mktemp("guard-logs")
    key_file = logs / "key"
    key_file.write_text(KEY + "\n")
    gw = Service("gateway", ["gateway", str(qwen3_path), "--port", "0",
                             "--served-model-name", "tiny", "--api-key-file", str(key_file),
                             "--max-queued-requests", "2", "--request-body-timeout", "2",
                             "--max-request-body-bytes", str(LIMIT),
                             "--registry-prefix", registry_prefix + "-guard"], logs)
    try:
        yield gw.info["http"]
    finally:
        gw.stop()


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _raw(url: str, head: bytes, body: bytes = b"") -> socket.socket:
    s = socket.create_connection(_host_port(url), timeout=30)
    s.sendall(head + body)
    return s


def _head(length: int | None, chunked: bool = False) -> bytes:
    lines = [b"POST /v1/completions HTTP/1.1", b"Host: 127.0.0.1",
             b"Content-Type: application/json", b"Authorization: Bearer " + KEY.encode()]
    if chunked:
        lines.append(b"Transfer-Encoding: chunked")
    elif length is not None:
        lines.append(b"Content-Length: " + str(length).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _status(s: socket.socket) -> tuple[int, bytes]:
    """The response's status and bytes (head and body)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1]), data


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def test_stalled_bodies_hold_no_slot_and_time_out(gateway):
    body = b'{"model": "tiny", "prompt": "hello", "max_tokens": 4}'
    stalled = [_raw(gateway, _head(len(body)), body[:10]) for _ in range(4)]
    try:
        time.sleep(0.3)  # all four are in, waiting on their bodies
        t0 = time.monotonic()
        r = httpx.post(gateway + "/v1/completions", headers=AUTH, timeout=10,
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
        # past the guard and the slot: no engine is registered, so 503 - not a 429
        assert r.status_code == 503, r.text
        assert time.monotonic() - t0 < 1.5
        for s in stalled:
            status, data = _status(s)
            assert status == 408 and b"--request-body-timeout" in data
    finally:
        for s in stalled:
            s.close()


@pytest.mark.parametrize("how", ["content-length", "chunked"])
def test_a_body_over_the_limit_is_refused_as_it_arrives(gateway, how):
    if how == "content-length":
        s = _raw(gateway, _head(LIMIT + 1))  # nothing of the body is sent
    else:
        s = _raw(gateway, _head(None, chunked=True))
        chunk = b"x" * 65536
        try:
            for _ in range(LIMIT // len(chunk) + 2):
                s.sendall(hex(len(chunk))[2:].encode() + b"\r\n" + chunk + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway answered and closed: the rest was never read
    try:
        status, data = _status(s)
        assert status == 413 and b"--max-request-body-bytes" in data
    finally:
        s.close()
    assert httpx.get(gateway + "/v1/models", headers=AUTH, timeout=10).status_code == 200


def test_the_gateway_answers_while_a_big_prompt_is_checked(gateway):
    text = "lorem ipsum dolor " * 50_000  # 900 kB: tokenized off the event loop
    got: dict[str, object] = {}

    def big() -> None:
        got["big"] = httpx.post(gateway + "/v1/completions", headers=AUTH, timeout=60,
                                json={"model": "tiny", "prompt": text})

    worker = threading.Thread(target=big)
    started = time.monotonic()
    worker.start()
    slowest = 0.0
    while worker.is_alive():
        t0 = time.monotonic()
        assert httpx.get(gateway + "/v1/models", headers=AUTH, timeout=10).status_code == 200
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.02)
    worker.join()
    checked_s = time.monotonic() - started
    r = got["big"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # a loop blocked by the check answers nothing until it is done (slowest ~ checked_s);
    # a second's allowance, or half the check on a box busy enough to stretch it
    assert slowest < max(1.0, checked_s / 2), (slowest, checked_s)


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/openapi.json", "/v1/models"])
def test_everything_but_health_needs_the_key(gateway, path):
    r = httpx.get(gateway + path, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(gateway + path, headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(gateway + "/health", timeout=10).status_code == 503  # no engines


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/completions", 405), ("POST", "/v1/nothing", 404),
    ("DELETE", "/v1/models", 405)])
def test_routing_refusals_are_openai_shaped(gateway, method, path, status):
    r = httpx.request(method, gateway + path, headers=AUTH, timeout=10)
    assert r.status_code == status
    assert r.json()["error"]["code"] == status and path in r.json()["error"]["message"]
