"""DecodeSession.generate's own logic, over an in-process session (no gRPC stream)."""

from __future__ import annotations

import asyncio

from pdmesh.services.gateway.clients import DecodeSession
from pdmesh.shared.proto import decode_pb2


def _session() -> DecodeSession:
    session = DecodeSession.__new__(DecodeSession)  # (the parts generate uses)
    session._outbox = asyncio.Queue()
    session._waiters = {}
    session.broken = None
    return session


def test_a_client_leaving_as_a_token_arrives_still_aborts():
    """The request's task is cancelled in the same loop turn as its next delta arrives:
    the cancellation must not be lost (Python 3.11's ``asyncio.wait_for`` returns the
    result instead), or the request decodes on, unanswered, to its end."""
    async def scenario() -> tuple[bool, list[str]]:
        session = _session()
        deltas = session.generate(decode_pb2.GenerateRequest(request_id="r"), 30.0)

        async def consume() -> None:
            async for _ in deltas:
                pass

        task = asyncio.create_task(consume())
        while "r" not in session._waiters:
            await asyncio.sleep(0)
        for _ in range(3):  # (it is waiting for the first delta)
            await asyncio.sleep(0)
        session._waiters["r"].put_nowait(decode_pb2.RequestOutput(
            request_id="r", chunk=decode_pb2.GenerateChunk(token_ids=[5])))
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2)
        sent = []
        while not session._outbox.empty():
            msg = session._outbox.get_nowait()
            sent.append(msg.WhichOneof("kind"))
        if not done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return bool(done) and task.cancelled(), sent

    cancelled, sent = asyncio.run(scenario())
    assert cancelled, "the cancellation was swallowed: the request went on decoding"
    assert sent == ["generate", "abort_request_id"]
