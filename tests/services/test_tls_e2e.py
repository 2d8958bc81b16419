"""A mesh with mutual TLS on its internal gRPC (and the cluster secret), as compose and
the Kubernetes manifests run it, as real processes on loopback: requests are served
with the offline engine's exact text; a caller in plain text, one that trusts the
mesh's CA but shows no certificate, and one with a certificate of another CA all fail
their handshake at every internal service; the mesh's own tools get through."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import httpx
import pytest

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.infra import cluster_auth, tls
from pdmesh.shared.proto import (
    common_pb2,
    decode_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    prefill_pb2_grpc,
)
from tests.mesh import MODEL, pd_mesh


@pytest.fixture(scope="module")
def mesh_tls(qwen3_path, tmp_path_factory, registry_prefix):
    folder = tmp_path_factory.mktemp("run-pdmesh")
    made = subprocess.run([sys.executable, "-m", "pdmesh", "cluster-secret",
                           str(folder / "cluster-secret"), "--tls"],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert all((folder / name).is_file() for name in tls.FILES)
    saved = {k: os.environ.get(k) for k in (cluster_auth.SECRET_FILE_ENV, tls.TLS_DIR_ENV)}
    os.environ[cluster_auth.SECRET_FILE_ENV] = str(folder / "cluster-secret")
    os.environ[tls.TLS_DIR_ENV] = str(folder)  # the children inherit both
    try:
        with pd_mesh(qwen3_path, tmp_path_factory.mktemp("tls-logs"),
                     registry_prefix + "-tls") as services:
            yield services, folder
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_requests_are_served_exactly(mesh_tls, qwen3_path):
    services, _ = mesh_tls
    prompts = [[5, 6, 7, 8], list(range(300, 340))]
    offline = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)
    want = [o.outputs[0].text for o in offline.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    for prompt, text in zip(prompts, want, strict=True):
        r = httpx.post(services["gateway"].info["http"] + "/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == text


def _health(role: str, channel: grpc.Channel):
    if role == "kvstore":
        return kvstore_pb2_grpc.KVStoreStub(channel).Stats(kvstore_pb2.StatsRequest(),
                                                           timeout=10)
    stub = (prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub)
    return stub(channel).Health(common_pb2.HealthRequest(), timeout=10,
                                metadata=cluster_auth.call_metadata())


def _strangers(folder) -> dict[str, grpc.ChannelCredentials | None]:
    ca = (folder / "ca.pem").read_bytes()
    other = tls.make()  # a certificate of another CA, for the same name
    return {"plain text": None,
            "no client certificate": grpc.ssl_channel_credentials(root_certificates=ca),
            "another CA's certificate": grpc.ssl_channel_credentials(
                root_certificates=ca, private_key=other.key, certificate_chain=other.cert)}


@pytest.mark.parametrize("role", ["prefill", "decode", "kvstore"])
def test_a_caller_without_the_mesh_certificate_is_refused(mesh_tls, role):
    services, folder = mesh_tls
    address = services[role].address
    for who, creds in _strangers(folder).items():
        channel = (grpc.insecure_channel(address) if creds is None else grpc.secure_channel(
            address, creds, options=[("grpc.ssl_target_name_override", tls.SERVER_NAME)]))
        with pytest.raises(grpc.RpcError) as info:
            _health(role, channel)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, who
        channel.close()
    answered = _health(role, cluster_auth.channel(address))  # the mesh's own client
    assert answered is not None


def test_the_mesh_tools_get_through(mesh_tls):
    services, _ = mesh_tls
    probe = subprocess.run([sys.executable, "-m", "pdmesh", "health", "--service",
                            "decode", "--grpc", services["decode"].address],
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr


def test_missing_certificates_stop_a_service_with_the_file_named(qwen3_path, tmp_path):
    bad = subprocess.run([sys.executable, "-m", "pdmesh", "kvstore", "--tls-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "cannot read ca.pem" in bad.stderr
