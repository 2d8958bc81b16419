"""The mesh's shared secret: who may call its internal gRPC services, and whose
registry entries a router believes.

The secret comes from PDMESH_CLUSTER_SECRET (its value) or PDMESH_CLUSTER_SECRET_FILE
(a file holding it; the services' ``--cluster-secret-file`` sets this), as a Kubernetes
Secret or a compose secret provides it. Without one, nothing is checked (one box, on
loopback: `pdmesh up`). With one, two keys are derived from it:

- a call token every internal gRPC client sends (metadata ``x-pdmesh-token``) and every
  internal gRPC server requires (else UNAUTHENTICATED) - knowing it lets one call the
  services, not forge registry entries;
- a signing key: every registry entry carries an HMAC of its fields, and an entry
  without a valid one is never routed to (nor used to find the kvstore).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import secrets
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc

from pdmesh.shared.infra.private_files import write_private

log = logging.getLogger(__name__)

SECRET_ENV = "PDMESH_CLUSTER_SECRET"
SECRET_FILE_ENV = "PDMESH_CLUSTER_SECRET_FILE"
TOKEN_HEADER = "x-pdmesh-token"


def secret() -> bytes | None:
    """The cluster secret, or None. ValueError naming the variable for an unreadable or
    empty file, or a secret too short to be one."""
    value = os.environ.get(SECRET_ENV, "")
    name = SECRET_ENV
    path = os.environ.get(SECRET_FILE_ENV, "")
    if not value and path:
        name = f"{SECRET_FILE_ENV} ({path})"
        try:
            with open(path, "rb") as f:
                value = f.read().strip().decode("utf-8", "replace")
        except OSError as e:
            raise ValueError(f"{name}: cannot read the cluster secret: {e.strerror}") from None
        if not value:
            raise ValueError(f"{name}: the cluster secret file is empty")
    if not value:
        return None
    if len(value) < 16:
        raise ValueError(f"{name}: the cluster secret must be at least 16 characters")
    return value.encode()


def per_run_secret(environ: Mapping[str, str] = os.environ) -> Path | None:
    """A fresh secret for one `pdmesh up` (or `serve`) run, unless the caller gave one
    (PDMESH_CLUSTER_SECRET / _FILE): its file, 0600 in a new 0700 folder (in /dev/shm
    where there is one: never on disk), for the run's services to read; the caller
    removes the folder when the run ends. None when one was given."""
    if environ.get(SECRET_ENV) or environ.get(SECRET_FILE_ENV):
        return None
    shm = Path("/dev/shm")
    folder = Path(tempfile.mkdtemp(prefix="pdmesh-secret-",
                                   dir=shm if shm.is_dir() and os.access(shm, os.W_OK)
                                   else None))
    path = folder / "cluster-secret"
    write_private(path, (secrets.token_hex(32) + "\n").encode())
    return path


def _derive(purpose: bytes) -> bytes | None:
    s = secret()
    return None if s is None else hmac.new(s, purpose, hashlib.sha256).digest()


def call_token() -> str | None:
    """What internal gRPC calls carry (None: no secret, nothing is sent or checked)."""
    key = _derive(b"pdmesh grpc call token v1")
    return None if key is None else key.hex()


def signing_key() -> bytes | None:
    return _derive(b"pdmesh registry signing key v1")


def sign(key: bytes, instance_id: str, fields: Mapping[str, Any]) -> str:
    """The HMAC of an instance's registry fields (load figures excluded: they change
    every beat and route nothing to an address)."""
    return hmac.new(key, _canonical(instance_id, fields), hashlib.sha256).hexdigest()


def verify(key: bytes, instance_id: str, fields: Mapping[str, Any]) -> bool:
    given = str(fields.get("sig", ""))
    return hmac.compare_digest(given, sign(key, instance_id, fields))


def sign_value(key: bytes, name: str, value: str) -> str:
    """The HMAC of one named value the registry keeps beside the instances (a LoRA
    adapter's folder, by the adapter's name)."""
    return hmac.new(key, f"{name}\n{value}".encode(), hashlib.sha256).hexdigest()


SIGNED_FIELDS = ("role", "address", "model", "dp_size", "dp_rank", "group", "draining")


def _canonical(instance_id: str, fields: Mapping[str, Any]) -> bytes:
    parts = [instance_id, *(f"{k}={fields.get(k, '')}" for k in SIGNED_FIELDS)]
    return "\n".join(parts).encode()


# -- gRPC ----------------------------------------------------------------------------------
def server_interceptors() -> list[Any]:
    """For a sync grpc.server: the token check (none without a secret)."""
    token = call_token()
    return [] if token is None else [_SyncCheck(token)]


def aio_server_interceptors() -> list[Any]:
    token = call_token()
    return [] if token is None else [_AioCheck(token)]


def channel(address: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    """A sync channel to an internal service, carrying the call token."""
    from pdmesh.shared.infra import tls

    ch = tls.channel(address, options=options)
    token = call_token()
    return ch if token is None else grpc.intercept_channel(ch, _SyncToken(token))


def call_metadata() -> tuple[tuple[str, str], ...]:
    """The metadata an internal call made on a plain grpc.aio channel must carry
    (empty without a secret). The aio side passes it per call rather than through a
    client interceptor, which would wrap every message of a long-lived stream (the
    gateway's decode sessions: one per token) in another Python hop."""
    return _metadata_for(os.environ.get(SECRET_ENV, ""), os.environ.get(SECRET_FILE_ENV, ""))


@functools.lru_cache(maxsize=4)
def _metadata_for(value: str, path: str) -> tuple[tuple[str, str], ...]:
    token = call_token()
    return () if token is None else ((TOKEN_HEADER, token),)


_REFUSAL = "missing or wrong cluster token (x-pdmesh-token): set the mesh's cluster secret"


def _authorized(metadata: Any, token: str) -> bool:
    given = next((v for k, v in metadata or () if k == TOKEN_HEADER), None)
    return isinstance(given, str) and hmac.compare_digest(given, token)


def _refusing(handler: grpc.RpcMethodHandler, aio: bool) -> grpc.RpcMethodHandler:
    """A handler of the same shape that refuses every call."""
    def refuse(request: Any, context: Any) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

    async def refuse_aio(request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

    fn = refuse_aio if aio else refuse
    kw = {"request_deserializer": handler.request_deserializer,
          "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(fn, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(fn, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(fn, **kw)
    return grpc.unary_unary_rpc_method_handler(fn, **kw)


class _SyncCheck(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self.token = token

    def intercept_service(self, continuation: Callable, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or _authorized(details.invocation_metadata, self.token):
            return handler
        return _refusing(handler, aio=False)


class _AioCheck(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self.token = token

    async def intercept_service(self, continuation: Callable, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or _authorized(details.invocation_metadata, self.token):
            return handler
        return _refusing(handler, aio=True)


# client side: the token added to every call's metadata
def _with_token(details: Any, token: str) -> Any:
    """(grpc hands sync interceptors its call details as a namedtuple)"""
    return details._replace(metadata=[*(details.metadata or ()), (TOKEN_HEADER, token)])


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self.token = token

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with_token(details, self.token), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_with_token(details, self.token), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(_with_token(details, self.token), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(_with_token(details, self.token), requests)


@functools.lru_cache(maxsize=4096)  # (bounded: forged ids are the writer's to choose)
def _warned(instance_id: str) -> bool:
    log.warning("registry entry %s is not signed with this mesh's cluster secret: "
                "ignored (never routed to)", instance_id)
    return True


def warn_unsigned(instance_id: str) -> None:
    """Once per entry."""
    _warned(instance_id)
