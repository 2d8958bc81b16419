"""How the gateway's failures are classified and answered, in one place.

    an instance's gRPC code ──CallFailed──▶ the journey: retry elsewhere, or give up
    giving up ──MeshError(http status)──▶ the OpenAI-shaped JSON error (or an SSE error
    event once a stream has started)
"""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

RETRY_AFTER_S = 1  # what a 429 tells the client to wait

# Worth trying another instance: the instance could not serve it, whoever's fault
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


class CallFailed(Exception):
    """A call to an instance ended without an answer; ``code`` says whose fault."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class MeshError(Exception):
    """The mesh could not serve the request; ``status`` is the HTTP status to answer
    (429: every instance was at its queue limit, worth retrying a little later)."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(message)
        self.status = status


def http_status(code: grpc.StatusCode) -> int:
    """The one gRPC -> HTTP mapping: the request's own fault is a 400, a queue limit a
    429, anything else the mesh's failure (503)."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return 400
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return 429
    return 503


def gave_up(role: str, codes: list[grpc.StatusCode], last: str) -> MeshError:
    """The error after every attempt at ``role`` failed: a 429 when each instance tried
    refused the request at its queue limit, else a 503 with the last reason."""
    if codes and all(c == grpc.StatusCode.RESOURCE_EXHAUSTED for c in codes):
        return MeshError(f"every {role} instance tried ({len(codes)}) is at its "
                         f"--max-queued-requests limit; retry later", 429)
    return MeshError(last)


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    if status == 429:
        return "rate_limit_error"
    if status in (401, 403):
        return "authentication_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """The answer to a refused request, in OpenAI's error shape (429 with Retry-After)."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return JSONResponse(status_code=status, headers=headers, content={"error": {
        "message": message, "type": error_type(status), "param": param, "code": status}})
