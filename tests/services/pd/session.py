"""One request over a ``Decode.Session`` stream, read like a unary stream: its chunks,
or a refusal raised with the instance's status code."""

from __future__ import annotations

import grpc

from pdmesh.shared.proto import decode_pb2

_CODES = {c.value[0]: c for c in grpc.StatusCode}


class Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class OneRequest:
    """``for chunk in OneRequest(stub, request)``; ``cancel()`` ends the stream (the
    instance aborts the request)."""

    def __init__(self, stub, request: decode_pb2.GenerateRequest, timeout: float = 60):
        self.call = stub.Session(iter([decode_pb2.SessionRequest(generate=request)]),
                                 timeout=timeout)
        self._chunks = self._read()

    def _read(self):
        for msg in self.call:
            for out in msg.outputs:
                if out.error_code:
                    raise Refused(_CODES[out.error_code], out.error_message)
                yield out.chunk
                if out.chunk.finish_reason:
                    return

    def __iter__(self):
        return self._chunks

    def __next__(self):
        return next(self._chunks)

    def cancel(self) -> None:
        self.call.cancel()


def prefill(stub, request, timeout: float = 60):
    """``Prefill``'s answer stream as one response: the first message holds the first
    token, the last says the prompt is stored (they may be one)."""
    msgs = list(stub.Prefill(request, timeout=timeout))
    assert msgs and msgs[-1].kv_stored and len(msgs) <= 2
    assert all(not m.kv_stored for m in msgs[:-1])
    whole = type(msgs[0])()
    for m in msgs:
        whole.MergeFrom(m)
    return whole
