"""The decode instance's gRPC edge runs in a process of its own (shared.runtime.edge): it
and the engine process live and die together, and requests pass between them intact."""

from __future__ import annotations

import os
import signal
import socket
import time

import grpc
import pytest

from pdmesh.shared.engine import SamplingParams
from pdmesh.shared.infra.launcher import Service
from pdmesh.shared.proto import common_pb2, decode_pb2, decode_pb2_grpc
from pdmesh.shared.runtime.proto_convert import sampling_to_proto
from tests.processes import alive
from tests.services.pd.session import OneRequest, prefill

ENGINE = ["--device", "cpu", "--dtype", "float32", "--block-size", "16"]


def edge_pid(engine_pid: int) -> int:
    with open(f"/proc/{engine_pid}/task/{engine_pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    edges = [p for p in children
             if b"pdmesh.services.decode.edge" in open(f"/proc/{p}/cmdline", "rb").read()]
    assert len(edges) == 1, children
    return edges[0]


def wait_gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def mixed(qwen3_path, tmp_path, registry_prefix):
    svc = Service("mixed", ["mixed", "--model", str(qwen3_path), *ENGINE,
                            "--registry-prefix", registry_prefix], tmp_path)
    try:
        yield svc
    finally:
        svc.stop(signal.SIGKILL)


def generate(address: str, prompt: list[int], n: int) -> list[int]:
    stub = decode_pb2_grpc.DecodeStub(grpc.insecure_channel(address))
    sp = sampling_to_proto(SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    out: list[int] = []
    for chunk in OneRequest(stub, decode_pb2.GenerateRequest(request_id="r",
                                                             prompt_token_ids=prompt,
                                                             sampling=sp), timeout=60):
        out += chunk.token_ids
    return out


def test_requests_and_health_pass_through_the_edge(mixed):
    assert len(generate(mixed.address, [5, 6, 7, 8], 12)) == 12
    stub = decode_pb2_grpc.DecodeStub(grpc.insecure_channel(mixed.address))
    health = stub.Health(common_pb2.HealthRequest(), timeout=10)
    assert health.serving and health.role == "mixed"
    assert health.load.total_kv_blocks > 0
    assert health.load.free_kv_blocks == health.load.total_kv_blocks
    with pytest.raises(grpc.RpcError) as e:  # refused by the engine, code kept
        generate(mixed.address, [5, 6, 99999999], 4)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids" in e.value.details()


def test_engine_stops_when_its_edge_dies(mixed):
    edge = edge_pid(mixed.proc.pid)
    os.kill(edge, signal.SIGKILL)
    assert wait_gone(mixed.proc.pid), "the engine process outlived its gRPC edge"


def test_edge_dies_with_its_engine(mixed):
    edge = edge_pid(mixed.proc.pid)
    os.kill(mixed.proc.pid, signal.SIGKILL)
    assert wait_gone(edge), "the gRPC edge outlived its engine process"
    with pytest.raises(grpc.RpcError) as e:
        generate(mixed.address, [5, 6, 7], 2)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_sigterm_to_the_engine_stops_both(mixed):
    edge = edge_pid(mixed.proc.pid)
    os.kill(mixed.proc.pid, signal.SIGTERM)  # drains (nothing in flight), then stops
    assert wait_gone(mixed.proc.pid) and wait_gone(edge)


def test_a_port_in_use_is_a_clear_error_naming_the_flag(qwen3_path):
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "pdmesh", "mixed", str(qwen3_path),
                            *ENGINE, "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"pdmesh: error: --port: cannot listen on 127.0.0.1:{port}" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("role", ["mixed", "prefill"])
def test_the_edge_on_a_thread_serves_the_same(qwen3_path, tmp_path, registry_prefix, role):
    """PDMESH_ENGINE_EDGE=thread: the same servicer over an InProcessEngineClient, no edge
    process; requests, refusals and Health behave as with the edge process."""
    from pdmesh.shared.proto import prefill_pb2, prefill_pb2_grpc

    extra = []
    if role == "prefill":  # a prefill instance needs a pool
        kv = Service("kvstore", ["kvstore", "--registry-prefix", registry_prefix], tmp_path)
        extra = ["--kvstore", kv.address, "--pool-segment-mb", "64"]
    svc = Service(role, [role, str(qwen3_path), *ENGINE, *extra, "--registry-prefix",
                         registry_prefix], tmp_path, env={"PDMESH_ENGINE_EDGE": "thread"})
    try:
        with open(f"/proc/{svc.proc.pid}/task/{svc.proc.pid}/children") as f:
            assert f.read().split() == []  # no edge process
        channel = grpc.insecure_channel(svc.address)
        if role == "mixed":
            assert len(generate(svc.address, [5, 6, 7, 8], 12)) == 12
            with pytest.raises(grpc.RpcError) as e:
                generate(svc.address, [5, 6, 99999999], 4)
            health = decode_pb2_grpc.DecodeStub(channel).Health(common_pb2.HealthRequest(),
                                                                 timeout=10)
        else:
            stub = prefill_pb2_grpc.PrefillStub(channel)
            sp = sampling_to_proto(SamplingParams(temperature=0, max_tokens=4))
            r = prefill(stub, prefill_pb2.PrefillRequest(request_id="a", prompt_token_ids=list(
                range(40)), sampling=sp), timeout=60)
            assert r.num_prompt_tokens == 40 and len(r.block_keys) == 3
            with pytest.raises(grpc.RpcError) as e:
                prefill(stub, prefill_pb2.PrefillRequest(request_id="b", prompt_token_ids=[
                    5, 99999999], sampling=sp), timeout=60)
            health = stub.Health(common_pb2.HealthRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt_token_ids" in e.value.details()
        assert health.serving and health.role == role and health.load.total_kv_blocks > 0
    finally:
        svc.stop()
        if extra:
            kv.stop()


def test_a_hung_engine_is_reported_stalled_by_its_edge(mixed):
    """The engine process stops inside its work (SIGSTOP to it alone; its edge answers
    on): the Health RPC reports the stall growing, `pdmesh health` calls it unhealthy
    past --stall-timeout, and both recover once the engine steps again."""
    import subprocess
    import sys
    import threading

    stub = decode_pb2_grpc.DecodeStub(grpc.insecure_channel(mixed.address))
    sp = sampling_to_proto(SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True))
    stream = OneRequest(stub, decode_pb2.GenerateRequest(request_id="long", sampling=sp,
                                                         prompt_token_ids=[5, 6, 7, 8]),
                        timeout=120)
    tokens: list[int] = []
    first = threading.Event()

    def consume() -> None:
        try:
            for chunk in stream:
                tokens.extend(chunk.token_ids)
                first.set()
        except grpc.RpcError as e:  # cancelled at the end
            assert e.code() == grpc.StatusCode.CANCELLED

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    assert first.wait(60)

    def probe() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pdmesh", "health", "--service", "mixed",
                               "--grpc", mixed.address, "--stall-timeout", "1.5"],
                              capture_output=True, text=True, timeout=60)

    assert probe().returncode == 0
    os.kill(mixed.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(2.5)
        health = stub.Health(common_pb2.HealthRequest(), timeout=10)
        assert health.load.stalled_ms >= 2000 and health.load.running == 1
        unhealthy = probe()
        assert unhealthy.returncode == 1 and "stalled for" in unhealthy.stderr
    finally:
        os.kill(mixed.proc.pid, signal.SIGCONT)
    n = len(tokens)
    deadline = time.monotonic() + 30
    while len(tokens) <= n:  # it steps again
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert stub.Health(common_pb2.HealthRequest(), timeout=10).load.stalled_ms < 1500
    assert probe().returncode == 0
    stream.cancel()
    reader.join(10)
