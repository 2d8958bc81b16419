"""The gateway's journey with fake instances: failover, refusals, hand-back and offload
run in milliseconds, without processes (the end-to-end tests cover the same over gRPC)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import pytest

from pdmesh.services.gateway.clients import Call, Stored
from pdmesh.services.gateway.errors import CallFailed, MeshError
from pdmesh.services.gateway.journey import Journey, Mesh, MeshRequest, RetryPolicy
from pdmesh.services.gateway.router import Router
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.infra.registry import Instance
from pdmesh.shared.runtime.protocol import TokenDelta

PROMPT = list(range(100, 140))
FAIL = object()  # in a decode script: the instance fails here (UNAVAILABLE)


class FakeRegistry:
    def __init__(self, *instances: Instance):
        self.found = list(instances)

    def instances(self, role=None, model=None) -> list[Instance]:
        return [i for i in self.found if role is None or i.role == role]

    def adapters(self) -> dict[str, str]:
        return {}


def inst(id_: str, role: str, **load: int) -> Instance:
    return Instance(id_, role, f"{id_}:1", "m", load=dict(load))


@dataclass
class FakePrefillCall:
    """A call's script: the first token (or a code it fails with first), then how its
    put ends: None (stored), a finish reason, or a code it fails with."""

    request_id: str
    first_token: int | grpc.StatusCode
    end: str | grpc.StatusCode | None
    keys: list[str]
    put_done: asyncio.Event | None = None  # the put waits for this, when given
    cancelled: bool = False

    async def first(self) -> TokenDelta:
        if isinstance(self.first_token, grpc.StatusCode):
            raise CallFailed(self.first_token, f"says {self.first_token.name}")
        return TokenDelta(self.request_id, [self.first_token], num_cached_tokens=16)

    async def stored(self) -> Stored:
        if self.put_done is not None:
            await self.put_done.wait()
        if isinstance(self.end, grpc.StatusCode):
            raise CallFailed(self.end, f"failed during the put: {self.end.name}")
        return Stored(self.keys, self.end)

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class FakePrefill:
    """``script``: instance id -> what each call there does: a first token (int), a gRPC
    code to fail with, or (first token, how its put ends: a finish reason or a code)."""

    script: dict[str, list]
    calls: list[tuple[str, Call]] = field(default_factory=list)
    answers: list[FakePrefillCall] = field(default_factory=list)
    put_done: asyncio.Event | None = None

    def prefill(self, instance: Instance, call: Call, timeout_s: float) -> FakePrefillCall:
        self.calls.append((instance.id, call))
        what = self.script[instance.id].pop(0)
        first, end = what if isinstance(what, tuple) else (what, None)
        answer = FakePrefillCall(call.request_id, first, end,
                                 [f"key-{len(call.carried)}-{k}" for k in range(3)],
                                 self.put_done)
        self.answers.append(answer)
        return answer


@dataclass
class FakeDecode:
    """``script``: instance id -> one list per call: tokens to stream (one delta each), a
    finish reason string ("length", "recomputed") to end with, FAIL to break mid-stream,
    or a gRPC code (refused before any token)."""

    script: dict[str, list[list]]
    calls: list[tuple[str, Call]] = field(default_factory=list)
    closed_early: list[str] = field(default_factory=list)

    def generate(self, instance: Instance, call: Call, idle_timeout_s: float,
                 stall=None) -> AsyncIterator[TokenDelta]:
        self.calls.append((instance.id, call))
        return self._stream(instance, call, self.script[instance.id].pop(0))

    async def _stream(self, instance: Instance, call: Call, steps: list
                      ) -> AsyncIterator[TokenDelta]:
        finished = False
        try:
            for i, step in enumerate(steps):
                if isinstance(step, grpc.StatusCode):
                    finished = True
                    raise CallFailed(step, f"{instance.id} refused")
                if step is FAIL:
                    finished = True
                    raise CallFailed(grpc.StatusCode.UNAVAILABLE, "decode session closed")
                if isinstance(step, str):
                    finished = True
                    yield TokenDelta(call.request_id, [], finish_reason=step)
                    return
                yield TokenDelta(call.request_id, [step], num_cached_tokens=40 if i == 0
                                 else 0)
        finally:
            if not finished:
                self.closed_early.append(call.request_id)


class Events:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.migrated = self._counter("migrated")
        self.handed_back = self._counter("handed_back")
        self.offloaded = self._counter("offloaded")

    def _counter(self, name: str):
        events = self

        class _C:
            def inc(self, n: float = 1) -> None:
                events.counts[name] = events.counts.get(name, 0) + int(n)

        return _C()

    def retried(self, role: str) -> None:
        self.counts[f"retried_{role}"] = self.counts.get(f"retried_{role}", 0) + 1


def journey(instances: list[Instance], prefill: dict, decode: dict, offload_threshold=0,
            max_hand_backs: int = 16, sampling: SamplingParams | None = None
            ) -> tuple[Callable, FakePrefill, FakeDecode, Events]:
    router = Router(FakeRegistry(*instances), offload_threshold=offload_threshold)  # type: ignore[arg-type]
    pre, dec, events = FakePrefill(prefill), FakeDecode(decode), Events()
    mesh = Mesh(router, pre, dec, RetryPolicy(backoff_s=0, max_hand_backs=max_hand_backs),
                events)  # type: ignore[arg-type]

    def start() -> Journey:
        return Journey(mesh, MeshRequest("req", PROMPT,
                                         sampling or SamplingParams(max_tokens=50)))

    return start, pre, dec, events


def run(j: Journey) -> list[TokenDelta]:
    async def collect() -> list[TokenDelta]:
        return [d async for d in j.run()]

    return asyncio.run(asyncio.wait_for(collect(), 5))


def tokens(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


PD = [inst("p1", "prefill"), inst("p2", "prefill"), inst("d1", "decode"),
      inst("d2", "decode", total_kv_blocks=10)]  # d2 has fewer free blocks: d1 goes first


def test_prefill_then_decode():
    start, pre, dec, _ = journey(PD, {"p1": [7], "p2": [7]}, {"d1": [[8, 9, "length"]]})
    deltas = run(start())
    assert tokens(deltas) == [7, 8, 9] and deltas[-1].finish_reason == "length"
    assert deltas[0].num_cached_tokens == 16  # the prompt's count, as prefill found it
    assert all(d.num_cached_tokens == 0 for d in deltas[1:])
    (where, call), = dec.calls
    assert where == "d1" and call.carried == [7] and call.block_keys == [
        "key-0-0", "key-0-1", "key-0-2"]


def test_decode_dies_mid_stream_and_another_continues():
    start, pre, dec, events = journey(PD, {"p1": [7], "p2": [7]},
                                      {"d1": [[8, 9, FAIL]], "d2": [[10, 11, "length"]]})
    deltas = run(start())
    assert tokens(deltas) == [7, 8, 9, 10, 11] and deltas[-1].finish_reason == "length"
    assert [w for w, _ in dec.calls] == ["d1", "d2"]
    assert dec.calls[1][1].carried == [7, 8, 9]  # the tokens so far travel along
    assert dec.calls[1][1].request_id != dec.calls[0][1].request_id
    assert events.counts == {"retried_decode": 1, "migrated": 1}


def test_prefill_refusal_tries_another_then_429_when_all_refuse():
    busy = grpc.StatusCode.RESOURCE_EXHAUSTED
    start, pre, dec, events = journey(PD, {"p1": [busy], "p2": [busy, 7]},
                                      {"d1": [[8, "length"]]})
    with pytest.raises(MeshError) as err:
        run(start())  # both refuse: 429, not 503
    assert err.value.status == 429 and "every prefill instance tried (2)" in str(err.value)
    assert not dec.calls
    p1_first = [inst("p1", "prefill"), inst("p2", "prefill", queued_prefill_tokens=10),
                inst("d1", "decode")]
    start2, pre2, _, events2 = journey(p1_first, {"p1": [busy], "p2": [7]},
                                       {"d1": [[8, "length"]]})
    assert tokens(run(start2())) == [7, 8]
    assert [w for w, _ in pre2.calls] == ["p1", "p2"]
    assert events2.counts == {"retried_prefill": 1}


def test_invalid_request_is_a_400_without_retries():
    start, pre, dec, _ = journey(PD, {"p1": [grpc.StatusCode.INVALID_ARGUMENT],
                                      "p2": [grpc.StatusCode.INVALID_ARGUMENT]}, {})
    with pytest.raises(MeshError) as err:
        run(start())
    assert err.value.status == 400 and len(pre.calls) == 1


def test_an_engine_error_finish_is_a_500_without_retries():
    """An "error" finish (the engine could not go on: an output its grammar refused) is
    answered as vLLM answers it, a 500, not a 200 and not retried elsewhere."""
    start, pre, dec, events = journey(PD, {"p1": [7], "p2": [7]},
                                      {"d1": [[8, "error"]], "d2": [[9, "length"]]})
    with pytest.raises(MeshError) as err:
        run(start())
    assert err.value.status == 500 and "generation failed" in str(err.value)
    assert [w for w, _ in dec.calls] == ["d1"] and not events.counts


def test_hand_back_re_prefills_the_tokens_so_far():
    one_prefill = [i for i in PD if i.id != "p2"]  # both prefills go to p1, in order
    start, pre, dec, events = journey(
        one_prefill, {"p1": [7, 12]},
        {"d1": [[8, 9, "recomputed"], [13, "length"]], "d2": [[13, "length"]]})
    deltas = run(start())
    assert tokens(deltas) == [7, 8, 9, 12, 13] and deltas[-1].finish_reason == "length"
    second_prefill = pre.calls[1][1]
    assert second_prefill.carried == [7, 8, 9] and second_prefill.request_id == "req-r1-p0"
    last_decode = dec.calls[-1][1]
    assert last_decode.carried == [7, 8, 9, 12]
    assert last_decode.block_keys[0] == "key-3-0"  # the re-prefilled prompt's keys
    assert events.counts == {"handed_back": 1}
    assert sum(d.num_cached_tokens for d in deltas) == 16  # counted once


def test_only_the_call_that_computes_the_first_token_asks_prompt_logprobs():
    """They come with the first token: the decode sessions after it, a migration's and
    a hand-back's re-prefill carry tokens and ask none (their prompt may come from the
    pool)."""
    one_prefill = [i for i in PD if i.id != "p2"]
    start, pre, dec, _ = journey(
        one_prefill, {"p1": [7, 12]},
        {"d1": [[8, FAIL]], "d2": [[9, "recomputed"], [13, "length"]]},
        sampling=SamplingParams(max_tokens=50, prompt_logprobs=2))
    assert tokens(run(start())) == [7, 8, 9, 12, 13]
    asked = [(c.carried, c.sampling.prompt_logprobs) for _, c in pre.calls + dec.calls]
    assert asked == [([], 2), ([7, 8, 9], None), ([7], None), ([7, 8], None),
                     ([7, 8, 9, 12], None)]


def test_hand_backs_are_bounded():
    start, _, _, _ = journey(PD, {"p1": [7] * 5, "p2": [7] * 5},
                             {"d1": [[8, "recomputed"]] * 5, "d2": [[8, "recomputed"]] * 5},
                             max_hand_backs=2)
    with pytest.raises(MeshError, match="handed the request back 2 times"):
        run(start())


def test_offload_lets_decode_compute_the_prompt_when_prefill_is_backed_up():
    # step costs published (prefill: 10 us per prompt token; decode: 5 ms steps), so the
    # 40-token prompt fits the decode TPOT budget
    backed_up = [inst("p1", "prefill", queued_prefill_tokens=5000, prefill_ns_per_token=10_000),
                 inst("d1", "decode", decode_step_us=5000)]
    start, pre, dec, events = journey(backed_up, {"p1": []}, {"d1": [[5, 6, "length"]]},
                                      offload_threshold=1000)
    j = start()
    deltas = run(j)
    assert tokens(deltas) == [5, 6] and not pre.calls
    assert dec.calls[0][1].carried == [] and dec.calls[0][1].block_keys == []
    assert deltas[0].num_cached_tokens == 40  # decode computed the prompt: its count
    assert events.counts == {"offloaded": 1}
    assert j.mesh.router.queued_tokens(backed_up[1]) == 0  # answered: no longer queued


def test_every_decode_instance_refusing_is_a_429():
    busy = grpc.StatusCode.RESOURCE_EXHAUSTED
    start, _, dec, events = journey(PD, {"p1": [7], "p2": [7]},
                                    {"d1": [[busy]], "d2": [[busy]]})
    with pytest.raises(MeshError) as err:
        run(start())
    assert err.value.status == 429 and "every decode instance tried (2)" in str(err.value)
    assert events.counts == {"retried_decode": 2}  # refused: nothing migrated


def test_mixed_instances_replace_one_at_its_queue_limit():
    mixed = [inst("m1", "mixed"), inst("m2", "mixed", running=5)]
    start, _, dec, _ = journey(mixed, {}, {"m1": [[grpc.StatusCode.RESOURCE_EXHAUSTED]],
                                           "m2": [[3, 4, "stop"]]})
    deltas = run(start())
    assert tokens(deltas) == [3, 4] and deltas[-1].finish_reason == "stop"
    assert [w for w, _ in dec.calls] == ["m1", "m2"]
    assert deltas[0].num_cached_tokens == 40 and deltas[1].num_cached_tokens == 0


def test_a_client_that_leaves_closes_the_decode_stream():
    start, _, dec, _ = journey(PD, {"p1": [7], "p2": [7]},
                               {"d1": [[8, 9, 10, 11, "length"]]})

    async def leave_early() -> None:
        deltas = start().run()
        assert (await anext(deltas)).token_ids == [7]
        assert (await anext(deltas)).token_ids == [8]
        await deltas.aclose()

    asyncio.run(asyncio.wait_for(leave_early(), 5))
    assert dec.closed_early == [dec.calls[0][1].request_id]


def test_the_first_token_goes_out_before_the_prompts_put_ends():
    start, pre, dec, _ = journey(PD, {"p1": [7], "p2": [7]}, {"d1": [[8, "length"]]})

    async def watch() -> list[TokenDelta]:
        pre.put_done = asyncio.Event()  # the put hangs until released
        deltas = start().run()
        first = await anext(deltas)
        assert first.token_ids == [7] and not first.finished
        assert not dec.calls  # decode waits for the pool
        pre.put_done.set()
        return [first] + [d async for d in deltas]

    deltas = asyncio.run(asyncio.wait_for(watch(), 5))
    assert tokens(deltas) == [7, 8]
    assert dec.calls[0][1].block_keys == ["key-0-0", "key-0-1", "key-0-2"]


def test_a_first_token_that_ends_the_request_skips_decode():
    start, pre, dec, _ = journey(PD, {"p1": [(7, "stop")], "p2": [(7, "stop")]}, {})
    deltas = run(start())
    assert tokens(deltas) == [7] and deltas[-1].finish_reason == "stop"
    assert not dec.calls


def test_prefill_failing_during_the_put_leaves_the_prompt_to_decode():
    gone = grpc.StatusCode.UNAVAILABLE
    start, pre, dec, _ = journey(PD, {"p1": [(7, gone)], "p2": [(7, gone)]},
                                 {"d1": [[8, 9, "length"]]})
    j = start()
    deltas = run(j)
    assert tokens(deltas) == [7, 8, 9] and len(pre.calls) == 1  # the token stands
    (_, call), = dec.calls
    assert call.carried == [7] and call.block_keys == []  # decode computes the prompt
    # the prefill instance's queue, as the router counts it, is settled
    assert [j.mesh.router.queued_tokens(i) for i in PD] == [0, 0, 0, 0]


def test_a_client_that_leaves_during_the_put_cancels_the_prefill():
    start, pre, dec, _ = journey(PD, {"p1": [7], "p2": [7]}, {"d1": [[8, "length"]]})
    j = start()

    async def leave() -> None:
        pre.put_done = asyncio.Event()
        deltas = j.run()
        assert (await anext(deltas)).token_ids == [7]
        await deltas.aclose()

    asyncio.run(asyncio.wait_for(leave(), 5))
    assert pre.answers[0].cancelled and not dec.calls
    assert [j.mesh.router.queued_tokens(i) for i in PD] == [0, 0, 0, 0]


@pytest.mark.parametrize("grace_s", [0.0, 2.0])
def test_the_only_decode_dies_and_the_stream_waits_for_it_to_come_back(grace_s):
    """Every decode instance gone mid-stream: the request waits up to the grace for one
    to register again (a supervisor's restart), and continues there; without a grace
    (or past it) it fails with 503."""
    instances = [inst("p1", "prefill"), inst("d1", "decode")]
    registry = FakeRegistry(*instances)
    router = Router(registry)  # type: ignore[arg-type]
    pre, dec, events = FakePrefill({"p1": [7]}), FakeDecode(
        {"d1": [[8, 9, FAIL]], "d2": [[10, "length"]]}), Events()
    mesh = Mesh(router, pre, dec, RetryPolicy(backoff_s=0, instance_grace_s=grace_s,
                                              grace_poll_s=0.01), events)  # type: ignore[arg-type]
    j = Journey(mesh, MeshRequest("req", PROMPT, SamplingParams(max_tokens=50)))

    async def collect() -> list[TokenDelta]:
        async def restart() -> None:  # d1's entry gone, d2 registers 0.3 s later
            registry.found.remove(instances[1])
            await asyncio.sleep(0.3)
            registry.found.append(inst("d2", "decode"))

        out, task = [], None
        async for d in j.run():
            out.append(d)
            if d.token_ids == [9]:  # (the next read finds d1 failed)
                task = asyncio.ensure_future(restart())
        await task
        return out

    if not grace_s:
        with pytest.raises(MeshError) as err:
            asyncio.run(asyncio.wait_for(collect(), 5))
        assert err.value.status == 503
        return
    deltas = asyncio.run(asyncio.wait_for(collect(), 5))
    assert tokens(deltas) == [7, 8, 9, 10] and [w for w, _ in dec.calls] == ["d1", "d2"]
