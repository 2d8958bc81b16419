"""A mesh with a cluster secret, as real processes on loopback: requests are served as
ever; an internal gRPC call without the mesh's token is refused (UNAUTHENTICATED) by
every internal service, the kvstore's Clear and Lookup included; a registry entry
written without the secret's signature is never routed to."""

from __future__ import annotations

import os
import socket
import threading

import grpc
import httpx
import pytest

from pdmesh.shared.infra import cluster_auth
from pdmesh.shared.infra.registry import Instance, Registry
from pdmesh.shared.proto import (
    common_pb2,
    decode_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    prefill_pb2_grpc,
)
from tests.mesh import MODEL, pd_mesh

SECRET = "test-cluster-secret-0123456789"


@pytest.fixture(scope="module")
def secured(qwen3_path, tmp_path_factory, registry_prefix):
    prefix = registry_prefix + "-auth"
    secret_file = tmp_path_factory.mktemp("secret") / "cluster-secret"
    secret_file.write_text(SECRET + "\n")
    before = os.environ.get(cluster_auth.SECRET_FILE_ENV)
    os.environ[cluster_auth.SECRET_FILE_ENV] = str(secret_file)  # the children inherit it
    try:
        with pd_mesh(qwen3_path, tmp_path_factory.mktemp("auth-logs"), prefix) as services:
            yield services, prefix
    finally:
        if before is None:
            os.environ.pop(cluster_auth.SECRET_FILE_ENV, None)
        else:
            os.environ[cluster_auth.SECRET_FILE_ENV] = before


def complete(url: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0})


def test_requests_are_served(secured):
    services, _ = secured
    r = complete(services["gateway"].info["http"], [5, 6, 7, 8])
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def _calls(address: str) -> dict[str, object]:
    """One call of each kind a stranger might try, on a plain channel (no token)."""
    ch = grpc.insecure_channel(address)
    return {"prefill-health": lambda: prefill_pb2_grpc.PrefillStub(ch).Health(
                common_pb2.HealthRequest(), timeout=10),
            "decode-health": lambda: decode_pb2_grpc.DecodeStub(ch).Health(
                common_pb2.HealthRequest(), timeout=10),
            "kvstore-clear": lambda: kvstore_pb2_grpc.KVStoreStub(ch).Clear(
                kvstore_pb2.ClearRequest(), timeout=10),
            "kvstore-lookup": lambda: kvstore_pb2_grpc.KVStoreStub(ch).Lookup(
                kvstore_pb2.LookupRequest(), timeout=10)}


@pytest.mark.parametrize(("role", "call"), [("prefill", "prefill-health"),
                                            ("decode", "decode-health"),
                                            ("kvstore", "kvstore-clear"),
                                            ("kvstore", "kvstore-lookup")])
def test_a_call_without_the_token_is_refused(secured, role, call):
    services, _ = secured
    with pytest.raises(grpc.RpcError) as info:
        _calls(services[role].address)[call]()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "cluster token" in info.value.details()


def test_a_call_with_the_token_is_answered(secured):
    services, _ = secured
    stub = decode_pb2_grpc.DecodeStub(cluster_auth.channel(services["decode"].address))
    assert stub.Health(common_pb2.HealthRequest(), timeout=10).role == "decode"


def test_a_forged_registry_entry_is_never_routed_to(secured):
    services, prefix = secured
    listener = socket.create_server(("127.0.0.1", 0))
    connections = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            connections.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    fake = Instance("decode-forged", "decode", f"127.0.0.1:{listener.getsockname()[1]}",
                    model=MODEL, load={"free_kv_blocks": 10**6, "total_kv_blocks": 10**6})
    saved = os.environ.pop(cluster_auth.SECRET_FILE_ENV)
    try:
        unsigned = Registry(prefix=prefix, ttl_s=120)  # a writer without the secret
        unsigned.put(fake)  # the least loaded decode there is, if it were believed
        assert "decode-forged" in {i.id for i in unsigned.instances("decode")}
    finally:
        os.environ[cluster_auth.SECRET_FILE_ENV] = saved
    try:
        assert "decode-forged" not in {i.id for i in Registry(prefix=prefix).instances()}
        url = services["gateway"].info["http"]
        for i in range(12):
            r = complete(url, [40 + i, 41, 42])
            assert r.status_code == 200, r.text
        assert connections == []
    finally:
        unsigned.remove("decode-forged")
        listener.close()
        for c in connections:
            c.close()


def test_the_secret_is_checked(monkeypatch, tmp_path):
    monkeypatch.delenv(cluster_auth.SECRET_ENV, raising=False)
    monkeypatch.setenv(cluster_auth.SECRET_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read the cluster secret"):
        cluster_auth.secret()
    monkeypatch.setenv(cluster_auth.SECRET_ENV, "short")
    with pytest.raises(ValueError, match="^PDMESH_CLUSTER_SECRET: .* at least 16"):
        cluster_auth.secret()
    monkeypatch.setenv(cluster_auth.SECRET_ENV, SECRET)
    key = cluster_auth.signing_key()
    fields = {"role": "decode", "address": "127.0.0.1:1", "model": "m", "dp_size": 1,
              "dp_rank": 0, "group": "", "draining": 0}
    signed = {**fields, "sig": cluster_auth.sign(key, "d-1", fields)}
    assert cluster_auth.verify(key, "d-1", signed)
    assert not cluster_auth.verify(key, "d-2", signed)  # bound to the instance id
    assert not cluster_auth.verify(key, "d-1", {**signed, "address": "10.0.0.1:1"})
    assert cluster_auth.call_token() != key.hex()  # the token cannot sign
