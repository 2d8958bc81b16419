"""What stands between a client's bytes and the routes: a generation request's body is
read here whole, within a size limit (413) and a time limit (408), checked to be JSON
the routes can take (400 naming the problem: not UTF-8, not JSON, nested too deeply, a
number past any field, a lone surrogate in a string), and only then handed on - so a
client that sends half a body and stalls holds a connection, never a request slot, and
a huge body never reaches the parser. Before the body, the API key (401) and the limit
on generation requests in flight (429, never queued).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pdmesh.services.gateway.errors import RETRY_AFTER_S

log = logging.getLogger(__name__)

# the POSTs whose JSON bodies are read here first
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
                    "/detokenize")
PARSE_OFF_LOOP_BYTES = 256 << 10  # bodies past this are parsed on a worker thread
OPEN_PATHS = ("/health", "/ping")  # answered without the API key (the probes)

ErrorResponse = Callable[[int, str, "str | None"], Any]  # (status, message, param)


class BodyError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def parse_body(body: bytes) -> Any:
    """The body's JSON value. BodyError naming what is wrong."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"body: not valid UTF-8 (byte {e.start})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise BodyError(f"body: not valid JSON ({e.msg} at character {e.pos})") from None
    except RecursionError:
        raise BodyError("body: JSON nested too deeply") from None
    except ValueError as e:  # an integer literal of more digits than Python converts
        raise BodyError(f"body: a number in it is too long ({e})") from None
    where = _lone_surrogate(value, [])
    if where is not None:
        field = ".".join(where) or None
        raise BodyError(f"{field or 'body'}: a string holds a lone UTF-16 surrogate (not "
                        f"text)", field)
    return value


def _lone_surrogate(value: Any, path: list[str]) -> list[str] | None:
    """Where, in ``value``, a string holds a surrogate code point (None: nowhere)."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return p
        elif isinstance(v, dict):
            for k, item in v.items():
                if isinstance(k, str) and _lone_surrogate(k, []) is not None:
                    return [*p]
                stack.append((item, [*p, str(k)]))
        elif isinstance(v, list):
            stack.extend((item, [*p, str(i)]) for i, item in enumerate(v))
    return None


class BodyGuard:
    """A plain ASGI middleware for POSTs to the generation paths (see the module)."""

    def __init__(self, app: Any, max_bytes: int, timeout_s: float, error: ErrorResponse):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.error = error

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or scope["path"] not in GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send, 413, self._too_large())
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except TimeoutError:
            await self._refuse(scope, receive, send, 408,
                               f"body: not received within {self.timeout_s:g} s "
                               f"(--request-body-timeout)")
            return
        except _TooLarge:
            await self._refuse(scope, receive, send, 413, self._too_large())
            return
        except _Gone:
            return  # the client left before sending its body: nobody to answer
        try:
            if len(body) > PARSE_OFF_LOOP_BYTES:
                await asyncio.to_thread(parse_body, body)
            else:
                parse_body(body)
        except BodyError as e:
            await self._refuse(scope, receive, send, 400, str(e), e.param)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Any) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Gone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> str:
        return (f"body: larger than {self.max_bytes} bytes (--max-request-body-bytes)")

    async def _refuse(self, scope: dict[str, Any], receive: Any, send: Any, status: int,
                      message: str, param: str | None = None) -> None:
        response = self.error(status, message, param)
        response.headers["Connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass


class _Gone(Exception):
    pass


def _replay(body: bytes, receive: Any) -> Callable[[], Awaitable[dict[str, Any]]]:
    """A receive that gives the body read already, then the client's own messages (its
    disconnect, for a streamed answer)."""
    given = False

    async def replay() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class ApiKey:
    """``Authorization: Bearer KEY`` on every path but /health and /ping (the API, /metrics and
    the API docs alike). A plain ASGI middleware: Starlette's BaseHTTPMiddleware would
    pass every streamed chunk through an extra task and queue."""

    def __init__(self, app: Any, key: str, error: ErrorResponse):
        self.app = app
        self.expected = f"Bearer {key}".encode()
        self.error = error

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization")
            if given is None or not hmac.compare_digest(given, self.expected):
                response = self.error(401, "missing or wrong API key", None)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class InFlight:
    """How many generation requests are being answered (the event loop's thread only)."""

    def __init__(self) -> None:
        self.count = 0


class InFlightLimit:
    """At most ``limit`` generation requests in flight (from arrival until the last byte
    of the answer, streamed or not; None: no limit, only counted); one more is answered
    429 with Retry-After at once, never queued. A plain ASGI middleware, so the slot is
    given back however the request ends (finished, failed, or the client went away)."""

    PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")

    def __init__(self, app: Any, limit: int | None, error: ErrorResponse,
                 rejected: Any = None, counter: InFlight | None = None):
        self.app = app
        self.error = error
        self.limit = limit
        self.rejected = rejected  # a counter
        self.in_flight = counter or InFlight()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in self.PATHS:
            await self.app(scope, receive, send)
            return
        if self.limit is not None and self.in_flight.count >= self.limit:
            if self.rejected is not None:
                self.rejected.inc()
            response = self.error(429, f"the gateway has {self.in_flight.count} requests "
                                       f"in flight, its --max-queued-requests limit; retry "
                                       f"after {RETRY_AFTER_S} s", None)
            await response(scope, receive, send)
            return
        self.in_flight.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight.count -= 1
