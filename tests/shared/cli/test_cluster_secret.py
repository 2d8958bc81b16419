"""`pdmesh cluster-secret`: a secret made once - to a file (compose) or as a Kubernetes
Secret through the API (here a loopback stand-in for the API server) - and kept after."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from pdmesh.shared.cli.cluster_secret import KEY, create_k8s_secret, write_file
from pdmesh.shared.infra import cluster_auth


def test_a_file_is_written_once(tmp_path, monkeypatch):
    path = tmp_path / "run" / "cluster-secret"
    assert write_file(path) is True
    first = path.read_text()
    assert write_file(path) is False and path.read_text() == first  # kept
    monkeypatch.delenv(cluster_auth.SECRET_ENV, raising=False)
    monkeypatch.setenv(cluster_auth.SECRET_FILE_ENV, str(path))
    assert cluster_auth.secret() == first.strip().encode()  # what the services read
    assert len(first.strip()) == 64
    assert path.stat().st_mode & 0o777 == 0o600  # its owner's alone, in a folder made
    assert path.parent.stat().st_mode & 0o777 == 0o700  # for it that is the owner's alone


def test_tls_files_beside_it_keep_the_key_private(tmp_path):
    from pdmesh.shared.infra import tls

    assert tls.write(tmp_path / "mesh") is True
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "mesh").iterdir()}
    assert modes == {"ca.pem": 0o644, "cert.pem": 0o644, "key.pem": 0o600}


def test_a_run_gets_its_own_secret_unless_one_is_given(tmp_path):
    given = {cluster_auth.SECRET_FILE_ENV: str(tmp_path / "s")}
    assert cluster_auth.per_run_secret(given) is None
    assert cluster_auth.per_run_secret({cluster_auth.SECRET_ENV: "x" * 32}) is None
    made = [cluster_auth.per_run_secret({}) for _ in range(2)]
    try:
        assert made[0] != made[1] and made[0].read_text() != made[1].read_text()
        for path in made:
            assert path.stat().st_mode & 0o777 == 0o600
            assert path.parent.stat().st_mode & 0o777 == 0o700
            assert len(path.read_text().strip()) == 64
    finally:
        import shutil

        for path in made:
            shutil.rmtree(path.parent)


class _Api(BaseHTTPRequestHandler):
    secrets: dict[str, dict] = {}

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        name = body["metadata"]["name"]
        assert self.path == "/api/v1/namespaces/mesh/secrets"
        code = 409 if name in self.secrets else 201
        self.secrets.setdefault(name, body)
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.fixture
def api():
    server = HTTPServer(("127.0.0.1", 0), _Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_k8s_secret_is_created_once(api):
    assert create_k8s_secret("pdmesh-cluster-secret", "mesh", api) is True
    made = _Api.secrets["pdmesh-cluster-secret"]
    value = base64.b64decode(made["data"][KEY]).decode()
    assert len(value) == 64 and made["type"] == "Opaque"
    assert create_k8s_secret("pdmesh-cluster-secret", "mesh", api) is False  # 409: kept
    assert base64.b64decode(_Api.secrets["pdmesh-cluster-secret"]["data"][KEY]).decode() \
        == value


def test_with_tls_the_secret_holds_a_ca_and_the_mesh_certificate(api, tmp_path, monkeypatch):
    """--tls: ca.pem, cert.pem, key.pem in the same Secret; written out as the pod's
    mount would show them, they are what the services load, and the certificate is the
    CA's, for the mesh's name, for servers and clients."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from pdmesh.shared.infra import tls

    assert create_k8s_secret("with-tls", "mesh", api, with_tls=True) is True
    data = {k: base64.b64decode(v) for k, v in _Api.secrets["with-tls"]["data"].items()}
    assert set(data) == {KEY, *tls.FILES}
    for name in tls.FILES:
        (tmp_path / name).write_bytes(data[name])
    monkeypatch.setenv(tls.TLS_DIR_ENV, str(tmp_path))
    loaded = tls.files()
    ca = x509.load_pem_x509_certificate(loaded.ca)
    cert = x509.load_pem_x509_certificate(loaded.cert)
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [tls.SERVER_NAME]
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)
    # a folder made by the file path way is kept as it is on the next run
    assert tls.write(tmp_path / "run") is True
    first = (tmp_path / "run" / "key.pem").read_bytes()
    assert tls.write(tmp_path / "run") is False
    assert (tmp_path / "run" / "key.pem").read_bytes() == first
