"""`pdmesh cluster-secret`: make the mesh's shared secret once, where its services read it.

    pdmesh cluster-secret /run/pdmesh/cluster-secret      # a file (docker compose's volume)
    pdmesh cluster-secret --k8s-secret pdmesh-cluster-secret   # a Kubernetes Secret
    ... --tls     also the mesh's CA, certificate and key (ca.pem, cert.pem, key.pem)
                  beside the file, or in the same Secret: mutual TLS (shared/infra/tls.py)

Either way a secret that is already there is kept (every service already started reads
it); a new one is 32 random bytes, hex. In Kubernetes the command runs in a Job whose
service account may create Secrets in its namespace, through the in-cluster API (the
pod's token and CA); the services mount the Secret and wait for it to exist.
"""

from __future__ import annotations

import argparse
import base64
import json
import secrets
import ssl
import urllib.error
import urllib.request
from pathlib import Path

from pdmesh.shared.infra.private_files import write_private

SA = Path("/var/run/secrets/kubernetes.io/serviceaccount")
KEY = "cluster-secret"  # the file's name in the Secret (and so under its mount)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", nargs="?", help="write the secret to this file")
    p.add_argument("--k8s-secret", default=None, metavar="NAME",
                   help="create this Kubernetes Secret (in the pod's namespace)")
    p.add_argument("--namespace", default=None, help="default: the pod's own")
    p.add_argument("--k8s-api", default="https://kubernetes.default.svc",
                   help="the Kubernetes API (in-cluster default)")
    p.add_argument("--tls", action="store_true",
                   help="also make the mesh's TLS certificates (ca.pem, cert.pem, key.pem)")


def run(a: argparse.Namespace) -> int:
    if bool(a.path) == bool(a.k8s_secret):
        raise ValueError("cluster-secret: give a file path or --k8s-secret NAME (one)")
    if a.path:
        made = write_file(Path(a.path))
        print(f"cluster secret {'written to' if made else 'kept in'} {a.path}")
        if a.tls:
            from pdmesh.shared.infra import tls

            folder = Path(a.path).parent
            made = tls.write(folder)
            print(f"TLS certificates {'written to' if made else 'kept in'} {folder}")
        return 0
    made = create_k8s_secret(a.k8s_secret, a.namespace, a.k8s_api, with_tls=a.tls)
    print(f"Kubernetes Secret {a.k8s_secret} {'created' if made else 'already there: kept'}")
    return 0


def new_secret() -> str:
    return secrets.token_hex(32)


def write_file(path: Path) -> bool:
    """Write a fresh secret unless the file holds one; True if written."""
    if path.is_file() and path.read_text().strip():
        return False
    write_private(path, (new_secret() + "\n").encode())  # 0600; a new folder 0700
    return True


def create_k8s_secret(name: str, namespace: str | None, api: str,
                      with_tls: bool = False) -> bool:
    """Create the Secret unless it exists; True if created. ConnectionError on an API
    that refuses (naming its answer)."""
    namespace = namespace or (SA / "namespace").read_text().strip()
    data = {KEY: new_secret().encode()}
    if with_tls:
        from pdmesh.shared.infra import tls

        made = tls.make()
        data.update(zip(tls.FILES, (made.ca, made.cert, made.key), strict=True))
    body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "pdmesh"}},
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}
    headers = {"Content-Type": "application/json"}
    token = SA / "token"
    if token.is_file():
        headers["Authorization"] = f"Bearer {token.read_text().strip()}"
    context = None
    if api.startswith("https://") and (SA / "ca.crt").is_file():
        context = ssl.create_default_context(cafile=str(SA / "ca.crt"))
    request = urllib.request.Request(f"{api}/api/v1/namespaces/{namespace}/secrets",
                                     data=json.dumps(body).encode(), headers=headers,
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30, context=context):
            return True
    except urllib.error.HTTPError as e:
        if e.code == 409:  # AlreadyExists: keep it
            return False
        raise ConnectionError(f"--k8s-secret: the API answered {e.code}: "
                              f"{e.read()[:300].decode(errors='replace')}") from None

