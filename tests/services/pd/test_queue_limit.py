"""An instance at its --max-queued-requests limit, over real gRPC in one process: the
prefill and decode edges answer RESOURCE_EXHAUSTED naming the limit (on a decode Session,
as that request's error_code), and the gateway, after trying every instance, turns it
into a 429 rather than a 503."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdmesh.services.decode.server import DecodeServicer
from pdmesh.services.gateway.clients import GrpcClients
from pdmesh.services.gateway.errors import CallFailed, MeshError
from pdmesh.services.gateway.journey import Journey, Mesh, MeshRequest
from pdmesh.services.prefill.server import PrefillServicer
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.infra.registry import Instance
from pdmesh.shared.proto import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from pdmesh.shared.runtime.proto_convert import sampling_to_proto
from pdmesh.shared.runtime.protocol import EngineLoad, QueueFull, TokenDelta, refused

SAMPLING = sampling_to_proto(SamplingParams(max_tokens=4))


class FullEngine:
    """An engine client whose engine's queue is always full."""

    max_model_len = 1 << 20
    draining = False

    def __init__(self) -> None:
        self.submitted = 0

    def load(self) -> EngineLoad:
        return EngineLoad()

    async def refresh(self) -> None: ...

    def submit(self, request, sink) -> None:
        self.submitted += 1
        sink.push(refused(request.request_id, QueueFull(3)))

    def abort(self, request_id: str) -> None:
        raise AssertionError("nothing was admitted, nothing to abort")


class FirstTokenEngine(FullEngine):
    """An engine client whose engine prefills at once: the first token, 7."""

    def submit(self, request, sink) -> None:
        sink.push(TokenDelta(request.request_id, [7], finish_reason="length"))


class OneEach:
    """A router over fixed instances (no registry)."""

    def __init__(self, instances: list[Instance]):
        self._instances = instances

    def instances(self, role: str) -> list[Instance]:
        return [i for i in self._instances if i.role == role]

    def pick(self, role, exclude=frozenset(), prompt=None, adapter=None):
        live = [i for i in self.instances(role) if i.id not in exclude]
        return live[0] if live else None

    def sent(self, inst, prompt) -> None: ...

    def answered(self, inst, prompt) -> None: ...

    def offload_target(self, prompt) -> None:
        return None  # prefill offload off

    def forget(self) -> None: ...


async def _serve(loop) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(loop, "m"), server)
    decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(loop, "m"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _drain(deltas) -> list[int]:
    tokens = []
    async for delta in deltas:
        tokens += delta.token_ids
    return tokens


def _journey(router, clients, rid: str, prompt: list[int], params):
    return Journey(Mesh(router, clients, clients), MeshRequest(rid, prompt, params)).run()


def test_edges_answer_resource_exhausted_and_the_gateway_429():
    """Runs in a child process: grpc.aio's poller thread, started in-process, can
    deadlock a later garbage collection of the test session (seen: a join in a
    finalizer that never returns), so the aio engine lives and dies with the child."""
    import subprocess
    import sys
    from pathlib import Path

    run = subprocess.run([sys.executable, "-c", "from tests.services.pd.test_queue_limit "
                          "import _edges_scenario; _edges_scenario()"],
                         cwd=Path(__file__).resolve().parents[3], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "scenario passed" in run.stdout


def _edges_scenario() -> None:
    async def scenario() -> None:
        loop = FullEngine()
        server, address = await _serve(loop)
        channels = GrpcClients()
        try:
            ch = channels.channel(address)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in prefill_pb2_grpc.PrefillStub(ch).Prefill(
                        prefill_pb2.PrefillRequest(request_id="p", prompt_token_ids=[1, 2],
                                                   sampling=SAMPLING),
                        timeout=10):
                    pass
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_queued_requests: 3" in info.value.details()
            session = channels.session(address)
            with pytest.raises(CallFailed) as failed:
                async for _ in session.generate(
                        decode_pb2.GenerateRequest(request_id="s", prompt_token_ids=[1],
                                                   sampling=SAMPLING), 10):
                    pass
            assert failed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert session.broken is None  # one request refused, the session serves on

            params = SamplingParams(max_tokens=4)
            for roles in (("prefill", "decode"), ("mixed",)):
                router = OneEach([Instance(f"{r}-1", r, address) for r in roles])
                with pytest.raises(MeshError) as err:
                    await _drain(_journey(router, channels, f"r-{roles[0]}", [1, 2],
                                          params))
                assert err.value.status == 429, err.value
                assert "--max-queued-requests" in str(err.value)
            assert loop.submitted == 4

            # prefill answers, every decode instance refuses: 429 after trying both
            pre_server, pre_address = await _serve(FirstTokenEngine())
            dec_server, dec_address = await _serve(loop)
            router = OneEach([Instance("p", "prefill", pre_address),
                              Instance("d1", "decode", address),
                              Instance("d2", "decode", dec_address)])
            pieces = _journey(router, channels, "r-pd", [1, 2], params)
            assert (await pieces.__anext__()).token_ids == [7]
            with pytest.raises(MeshError) as err:
                await _drain(pieces)
            assert err.value.status == 429 and "every decode instance tried (2)" in str(
                err.value)
            assert loop.submitted == 6
            await pre_server.stop(0)
            await dec_server.stop(0)
        finally:
            await channels.close()
            await server.stop(0)

    asyncio.run(asyncio.wait_for(scenario(), 60))
    print("scenario passed", flush=True)
