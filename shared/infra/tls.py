"""Mutual TLS on the mesh's internal gRPC: every server proves itself to its callers and
every caller to the server, with certificates of the mesh's own CA.

The certificates live in one folder - PDMESH_TLS_DIR (the services' ``--tls-dir`` sets
it) - as ``ca.pem`` (the CA that signed them), ``cert.pem`` and ``key.pem`` (the mesh's
certificate and key, which every service presents, as server and as client).
``pdmesh cluster-secret --tls`` makes them beside the cluster secret, in the same volume
or Kubernetes Secret. Without the folder, gRPC runs in plain text (one box on loopback:
`pdmesh up`); with it, a caller without a certificate of the mesh's CA fails its
handshake.

Services are reached at many names (service names, pod IPs, loopback), so the
certificate names the mesh itself, ``SERVER_NAME``, and callers check that name
whatever address they dialled (``grpc.ssl_target_name_override``).
"""

from __future__ import annotations

import datetime
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pdmesh.shared.infra.private_files import write_private

TLS_DIR_ENV = "PDMESH_TLS_DIR"
SERVER_NAME = "pdmesh.internal"
FILES = ("ca.pem", "cert.pem", "key.pem")


@dataclass(frozen=True)
class TlsFiles:
    ca: bytes
    cert: bytes
    key: bytes


def files() -> TlsFiles | None:
    """The mesh's certificates, or None (plain text). ValueError naming the variable
    and the file for a folder that lacks one."""
    folder = os.environ.get(TLS_DIR_ENV, "")
    return _read(folder) if folder else None


@functools.lru_cache(maxsize=4)
def _read(folder: str) -> TlsFiles:
    found = []
    for name in FILES:
        path = Path(folder) / name
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ValueError(f"{TLS_DIR_ENV} ({folder}): cannot read {name}: "
                             f"{e.strerror} (pdmesh cluster-secret --tls makes the "
                             "three files)") from None
        if not data.strip():
            raise ValueError(f"{TLS_DIR_ENV} ({folder}): {name} is empty")
        found.append(data)
    return TlsFiles(*found)


def enabled() -> bool:
    return files() is not None


# -- gRPC ----------------------------------------------------------------------------------
def add_port(server: Any, address: str) -> int:
    """Listen on ``address`` (sync or aio server): with mutual TLS when configured."""
    tls = files()
    if tls is None:
        return server.add_insecure_port(address)
    creds = grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca,
                                        require_client_auth=True)
    return server.add_secure_port(address, creds)


def _client(options: list[tuple[str, Any]] | None) -> tuple[Any, list[tuple[str, Any]]]:
    tls = files()
    opts = list(options or [])
    if tls is None:
        return None, opts
    creds = grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key,
                                         certificate_chain=tls.cert)
    return creds, [*opts, ("grpc.ssl_target_name_override", SERVER_NAME)]


def channel(address: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    creds, opts = _client(options)
    if creds is None:
        return grpc.insecure_channel(address, options=opts or None)
    return grpc.secure_channel(address, creds, options=opts)


def aio_channel(address: str, options: list[tuple[str, Any]] | None = None
                ) -> grpc.aio.Channel:
    creds, opts = _client(options)
    if creds is None:
        return grpc.aio.insecure_channel(address, options=opts or None)
    return grpc.aio.secure_channel(address, creds, options=opts)


# -- making them -----------------------------------------------------------------------------
def make(days: int = 3650) -> TlsFiles:
    """A fresh CA and the mesh's certificate (EC P-256), signed by it, naming
    ``SERVER_NAME``, for servers and clients alike."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdmesh cluster CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False,
                                       decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return TlsFiles(
        ca=ca.public_bytes(pem), cert=cert.public_bytes(pem),
        key=key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def write(folder: Path) -> bool:
    """Write a fresh set into ``folder`` unless it holds one; True if written."""
    paths = [folder / name for name in FILES]
    if all(p.is_file() and p.stat().st_size for p in paths):
        return False
    made = make()
    for path, data, mode in zip(paths, (made.ca, made.cert, made.key), (0o644, 0o644, 0o600),
                                strict=True):  # (the key its owner's alone)
        write_private(path, data, mode)
    return True
