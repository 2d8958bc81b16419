"""The engine protocol's codec and the engine's socket port over a real socket pair."""

from __future__ import annotations

import random
import socket
import threading

from pdmesh.shared.engine.request import Logprob
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.runtime.link import SocketPort
from pdmesh.shared.runtime.protocol import (
    AbortRequest,
    EngineLoad,
    Failure,
    FrameReader,
    FromEngine,
    LoadQuery,
    Status,
    StepOutputs,
    SubmitRequest,
    ToEngine,
    TokenDelta,
    encode,
)


def test_frames_survive_any_split_of_the_byte_stream():
    rng = random.Random(0)
    messages = [SubmitRequest(f"r{i}", list(range(rng.randrange(0, 5000))),
                              SamplingParams(max_tokens=i + 1, seed=i), i, [i])
                for i in range(40)]
    messages += [AbortRequest("r3"), LoadQuery()]
    data = b"".join(encode(m) for m in messages)
    reader, out, i = FrameReader(ToEngine), [], 0
    while i < len(data):
        n = rng.choice([1, 3, 7, 100, 4096, 65536])
        out += reader.feed(data[i:i + n])
        i += n
    assert out == messages


def test_every_delta_field_round_trips():
    deltas = [TokenDelta("a", [5, 6], num_cached_tokens=3),
              TokenDelta("b", [7], finish_reason="length", stop_reason=None,
                         kv_keys=["k1"], timing={"arrival": 1.5, "kv_get": (1.0, 2.0)}),
              TokenDelta("c", [8], logprobs=[{8: Logprob(-0.5, 1), 9: Logprob(-2.0, 2)}]),
              TokenDelta("e", [4], prompt_logprobs=[None, {3: Logprob(-1.0, 2),
                                                           1: Logprob(-0.5, 1)}]),
              TokenDelta("d", error=Failure(Status.RESOURCE_EXHAUSTED, "full"))]
    back = FrameReader(FromEngine).feed(encode(StepOutputs(deltas)) + encode(EngineLoad(1, 2)))
    assert back[1] == EngineLoad(1, 2)
    got = back[0].deltas
    assert [d.finished for d in got] == [False, True, False, False, True]
    for sent, received in zip(deltas, got, strict=True):
        if sent.timing:  # msgpack has no tuples: the pair comes back as a list
            assert received.timing == {"arrival": 1.5, "kv_get": [1.0, 2.0]}
            received.timing = sent.timing
        assert received == sent


def test_merged_deltas_keep_the_first_cached_count_and_the_last_ending():
    a = TokenDelta("r", [1], num_cached_tokens=4)
    b = TokenDelta("r", [2, 3], finish_reason="stop", stop_reason=3, kv_keys=["k"])
    m = a.then(b)
    assert (m.token_ids, m.finish_reason, m.stop_reason, m.num_cached_tokens, m.kv_keys) == \
        ([1, 2, 3], "stop", 3, 4, ["k"])
    first = TokenDelta("r", [1], prompt_logprobs=[None])
    assert first.then(b).prompt_logprobs == [None]  # (they come with the first token)


def test_socket_port_never_blocks_reading_and_sees_the_edge_close():
    ours, theirs = socket.socketpair()
    port = SocketPort(ours)
    assert port.receive() == []  # nothing there: returns at once
    big = SubmitRequest("r", list(range(200_000)), SamplingParams())  # several buffers
    writer = threading.Thread(target=lambda: theirs.sendall(encode(big) +
                                                            encode(AbortRequest("r"))))
    writer.start()
    got: list = []
    while len(got) < 2:
        port.wait(1.0)
        got += port.receive()
    writer.join()
    assert got == [big, AbortRequest("r")]
    port.send([TokenDelta("r", [1]), TokenDelta("r", [2], finish_reason="length")])
    port.send([])  # nothing to send: no message
    port.publish(EngineLoad(running=1))
    reader = FrameReader(FromEngine)
    received: list = []
    while len(received) < 2:
        received += reader.feed(theirs.recv(1 << 16))
    step, load = received
    assert [d.token_ids for d in step.deltas] == [[1], [2]] and load.running == 1
    theirs.close()
    port.wait(1.0)
    assert port.receive() == [] and port.closed
    port.publish(EngineLoad())  # writing to a closed port is a no-op, not an error
