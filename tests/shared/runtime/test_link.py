"""The engine <-> gRPC edge wire (pdmesh.shared.runtime.link) over a real socket pair."""

from __future__ import annotations

import random
import socket
import threading

from pdmesh.shared.engine.request import Logprob
from pdmesh.shared.runtime.link import EngineLink, FrameReader, decode_event, encode_event, frame
from pdmesh.shared.runtime.loop import StreamEvent


def test_frames_survive_any_split_of_the_byte_stream():
    rng = random.Random(0)
    messages = [("add", f"r{i}", list(range(rng.randrange(0, 5000))), {"x": i}, i, None)
                for i in range(40)]
    data = b"".join(frame(m) for m in messages)
    reader, out, i = FrameReader(), [], 0
    while i < len(data):
        n = rng.choice([1, 3, 7, 100, 4096, 65536])
        out += reader.feed(data[i:i + n])
        i += n
    assert out == messages


def test_events_round_trip_in_short_and_whole_form():
    plain = StreamEvent([5, 6], num_cached_tokens=3)
    assert len(encode_event("a", plain)) == 3  # the common case: a bare tuple
    rid, back = decode_event(encode_event("a", plain))
    assert rid == "a" and back.token_ids == [5, 6] and back.num_cached_tokens == 3
    for full in (StreamEvent([7], finished=True, finish_reason="length"),
                 StreamEvent([8], logprobs=[{8: Logprob(-0.5, 1)}]),
                 StreamEvent([], finished=True, error="no", error_code="INVALID_ARGUMENT"),
                 StreamEvent([9], kv_keys=["k1"])):
        rid, back = decode_event(encode_event("b", full))
        assert rid == "b" and back == full


def test_engine_link_never_blocks_reading_and_sees_the_edge_close():
    ours, theirs = socket.socketpair()
    link = EngineLink(ours)
    assert link.receive() == []  # nothing there: returns at once
    big = ("add", "r", list(range(200_000)), None, 0, None)  # several socket buffers
    writer = threading.Thread(target=lambda: theirs.sendall(frame(big) + frame(("abort", "r"))))
    writer.start()
    got: list = []
    while len(got) < 2:
        link.wait(1.0)
        got += link.receive()
    writer.join()
    assert got == [big, ("abort", "r")]
    link.put("r", StreamEvent([1]))
    link.put("r", StreamEvent([2], finished=True))
    link.flush()
    reader = FrameReader()
    kind, items = reader.feed(theirs.recv(1 << 16))[0]
    assert kind == "events" and [decode_event(i)[1].token_ids for i in items] == [[1], [2]]
    theirs.close()
    link.wait(1.0)
    assert link.receive() == [] and link.closed
    link.send(("load", {}, False, 0))  # writing to a closed link is a no-op, not an error
