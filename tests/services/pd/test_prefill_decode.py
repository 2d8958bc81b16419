"""Prefill and decode instances as real processes, KV through the real Mooncake pool."""

from __future__ import annotations

import queue
import time

import grpc
import pytest

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.infra.launcher import Service
from pdmesh.shared.proto import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from pdmesh.shared.runtime.proto_convert import sampling_to_proto
from tests.mesh import stop_all
from tests.services.pd.session import OneRequest, prefill

PROMPTS = [list(range(200, 247)), list(range(300, 332)), [7, 8, 9]]
NEW = 10
ENGINE = ["--device", "cpu", "--dtype", "float32", "--block-size", "16",
          "--pool-segment-mb", "64"]


@pytest.fixture(scope="module")
def mesh(qwen3_path, tmp_path_factory, registry_prefix):
    logs = tmp_path_factory.mktemp("pd-logs")
    reg = ["--registry-prefix", registry_prefix]
    started: list[Service] = []
    try:
        kv = Service("kvstore", ["kvstore", *reg], logs)
        started.append(kv)
        for role in ("prefill", "decode"):
            started.append(Service(role, [role, "--model", str(qwen3_path), "--kvstore",
                                          kv.address, *ENGINE, *reg], logs))
        yield {s.role: s for s in started}
    finally:
        stop_all(started)


@pytest.fixture(scope="module")
def expected(qwen3_path):
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def stubs(mesh):
    return (prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(mesh["prefill"].address)),
            decode_pb2_grpc.DecodeStub(grpc.insecure_channel(mesh["decode"].address)))


def test_instances_register_in_redis(mesh, registry_prefix):
    from pdmesh.shared.infra.registry import Registry

    found = {i.role: i for i in Registry(prefix=registry_prefix).instances()}
    assert found["prefill"].address == mesh["prefill"].address
    assert found["decode"].address == mesh["decode"].address
    assert found["kvstore"].address == mesh["kvstore"].address
    assert found["decode"].load["total_kv_blocks"] > 0


def test_prefill_then_decode_equals_offline(mesh, expected):
    pre, dec = stubs(mesh)
    sp = sampling_to_proto(SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    for i, prompt in enumerate(PROMPTS):
        r = prefill(pre, prefill_pb2.PrefillRequest(request_id=f"p{i}", prompt_token_ids=prompt,
                                                   sampling=sp), timeout=60)
        assert r.num_prompt_tokens == len(prompt) and len(r.block_keys) == -(-len(prompt) // 16)
        tokens = [r.first_token]
        last = None
        for chunk in OneRequest(dec, decode_pb2.GenerateRequest(
                request_id=f"d{i}", prompt_token_ids=prompt, output_token_ids=tokens,
                block_keys=r.block_keys, sampling=sp), timeout=60):
            tokens += list(chunk.token_ids)
            last = chunk
        assert last is not None and last.finish_reason == "length"
        assert tokens == expected[i]


def test_min_tokens_past_the_first_token_hold_on_prefill(mesh, expected):
    """Prefill makes one token of a request that asks for min_tokens more: it is served
    (it was refused: "min_tokens: must be <= max_tokens (1)") and its first token still
    cannot be a stop token."""
    pre, _ = stubs(mesh)
    first = expected[0][0]
    sp = sampling_to_proto(SamplingParams(temperature=0, max_tokens=9, min_tokens=7,
                                          stop_token_ids=[first]))
    r = prefill(pre, prefill_pb2.PrefillRequest(request_id="min", prompt_token_ids=PROMPTS[0],
                                               sampling=sp), timeout=60)
    assert r.first_token != first and r.num_prompt_tokens == len(PROMPTS[0])


def test_carried_tokens_a_grammar_refuses_end_as_an_error_on_both_roles(mesh):
    """A request arriving with output its grammar refuses (re-prefilled or continued
    elsewhere) ends with finish_reason "error" on prefill and on decode (the gateway's
    500), not as a silent "stop"."""
    from pdmesh.shared.engine.structured import choice_grammar

    pre, dec = stubs(mesh)
    sp = sampling_to_proto(SamplingParams(temperature=0, max_tokens=9,
                                          grammar=choice_grammar(["yes"])))
    r = prefill(pre, prefill_pb2.PrefillRequest(
        request_id="g-pre", prompt_token_ids=PROMPTS[0], output_token_ids=[7, 8],
        sampling=sp), timeout=60)
    assert r.finish_reason == "error"
    chunks = list(OneRequest(dec, decode_pb2.GenerateRequest(
        request_id="g-dec", prompt_token_ids=PROMPTS[0], output_token_ids=[7, 8],
        sampling=sp), timeout=60))
    assert chunks[-1].finish_reason == "error"


def test_bad_input_is_invalid_argument(mesh):
    pre, dec = stubs(mesh)
    sp = sampling_to_proto(SamplingParams(max_tokens=4))
    with pytest.raises(grpc.RpcError) as e:
        prefill(pre, prefill_pb2.PrefillRequest(prompt_token_ids=[1, 999999], sampling=sp),
                    timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids" in e.value.details()
    bad = sampling_to_proto(SamplingParams(max_tokens=4))
    bad.top_p = 3.0
    with pytest.raises(grpc.RpcError) as e:
        next(OneRequest(dec, decode_pb2.GenerateRequest(request_id="bad",
                                                        prompt_token_ids=[1, 2],
                                                        output_token_ids=[3], sampling=bad),
                        timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in e.value.details()


def test_cancelled_stream_frees_its_blocks(mesh):
    pre, dec = stubs(mesh)
    sp = sampling_to_proto(SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
    r = prefill(pre, prefill_pb2.PrefillRequest(prompt_token_ids=PROMPTS[0], sampling=sp),
                    timeout=60)
    call = OneRequest(dec, decode_pb2.GenerateRequest(
        request_id="long", prompt_token_ids=PROMPTS[0], output_token_ids=[r.first_token],
        block_keys=r.block_keys, sampling=sp), timeout=120)
    next(call)
    load = dec.Health(common_pb2.HealthRequest(), timeout=10).load
    assert load.running == 1 and load.free_kv_blocks < load.total_kv_blocks
    call.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        load = dec.Health(common_pb2.HealthRequest(), timeout=10).load
        if load.running == 0 and load.free_kv_blocks == load.total_kv_blocks:
            break
        time.sleep(0.05)
    assert load.running == 0 and load.free_kv_blocks == load.total_kv_blocks


def _prefilled(pre, sp, prompts):
    return [prefill(pre, prefill_pb2.PrefillRequest(prompt_token_ids=p, sampling=sp), timeout=60)
            for p in prompts]


def _wait_idle(dec) -> common_pb2.WorkerLoad:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        load = dec.Health(common_pb2.HealthRequest(), timeout=10).load
        if load.running == 0 and load.waiting == 0 and load.free_kv_blocks == load.total_kv_blocks:
            break
        time.sleep(0.05)
    return load


def test_session_serves_many_requests_one_message_per_step(mesh, expected):
    """Every prompt through one Session stream gives the same tokens as one request per
    stream; an invalid request on it fails alone with INVALID_ARGUMENT; steps arrive
    batched."""
    pre, dec = stubs(mesh)
    sp = sampling_to_proto(SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    firsts = _prefilled(pre, sp, PROMPTS)
    bad = sampling_to_proto(SamplingParams(max_tokens=4))
    bad.top_p = 3.0
    msgs = [decode_pb2.SessionRequest(generate=decode_pb2.GenerateRequest(
        request_id=f"s{i}", prompt_token_ids=p, output_token_ids=[r.first_token],
        block_keys=r.block_keys, sampling=sp))
        for i, (p, r) in enumerate(zip(PROMPTS, firsts, strict=True))]
    msgs.insert(1, decode_pb2.SessionRequest(generate=decode_pb2.GenerateRequest(
        request_id="bad", prompt_token_ids=[1, 2], output_token_ids=[3], sampling=bad)))
    tokens = {f"s{i}": [r.first_token] for i, r in enumerate(firsts)}
    finished: dict[str, str] = {}
    errors: dict[str, tuple[int, str]] = {}
    sizes = []
    call = dec.Session(iter(msgs), timeout=60)
    for out in call:
        rids = [o.request_id for o in out.outputs]
        assert len(rids) == len(set(rids))  # steps that piled up arrive merged
        sizes.append(len(rids))
        for o in out.outputs:
            if o.error_code:
                errors[o.request_id] = (o.error_code, o.error_message)
                continue
            tokens[o.request_id] += list(o.chunk.token_ids)
            if o.chunk.finish_reason:
                finished[o.request_id] = o.chunk.finish_reason
    # the client closed its side after sending: the stream ends when all are finished
    assert errors == {"bad": (grpc.StatusCode.INVALID_ARGUMENT.value[0], errors["bad"][1])}
    assert "top_p" in errors["bad"][1]
    assert finished == {f"s{i}": "length" for i in range(len(PROMPTS))}
    assert [tokens[f"s{i}"] for i in range(len(PROMPTS))] == expected
    assert max(sizes) <= len(PROMPTS)
    assert _wait_idle(dec).running == 0


def test_session_sends_one_message_per_step(mesh):
    """Requests that run together on a Session get a step's tokens in one message. Outputs
    are long so that the requests overlap however their pool reads are scheduled."""
    pre, dec = stubs(mesh)
    sp = sampling_to_proto(SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    firsts = _prefilled(pre, sp, PROMPTS)
    msgs = [decode_pb2.SessionRequest(generate=decode_pb2.GenerateRequest(
        request_id=f"m{i}", prompt_token_ids=p, output_token_ids=[r.first_token],
        block_keys=r.block_keys, sampling=sp))
        for i, (p, r) in enumerate(zip(PROMPTS, firsts, strict=True))]
    counts = {f"m{i}": 1 for i in range(len(PROMPTS))}
    sizes = []
    for out in dec.Session(iter(msgs), timeout=120):
        rids = [o.request_id for o in out.outputs]
        assert len(rids) == len(set(rids)) and not any(o.error_code for o in out.outputs)
        sizes.append(len(rids))
        for o in out.outputs:
            counts[o.request_id] += len(o.chunk.token_ids)
    assert counts == {f"m{i}": 300 for i in range(len(PROMPTS))}
    assert max(sizes) == len(PROMPTS)  # a step's tokens for all requests in one message
    assert len(sizes) < sum(counts.values()) // 2  # not a message per request per step
    assert _wait_idle(dec).running == 0


def test_session_abort_and_close_free_blocks(mesh):
    pre, dec = stubs(mesh)
    sp = sampling_to_proto(SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
    firsts = _prefilled(pre, sp, PROMPTS[:2])
    outbox: queue.Queue = queue.Queue()
    for i, (p, r) in enumerate(zip(PROMPTS[:2], firsts, strict=True)):
        outbox.put(decode_pb2.SessionRequest(generate=decode_pb2.GenerateRequest(
            request_id=f"long{i}", prompt_token_ids=p, output_token_ids=[r.first_token],
            block_keys=r.block_keys, sampling=sp)))
    call = dec.Session(iter(outbox.get, None), timeout=120)
    try:
        _abort_then_close(dec, call, outbox)
    finally:
        outbox.put(None)  # ends the request iterator (grpc joins its thread on cleanup)
    load = _wait_idle(dec)
    assert load.running == 0 and load.free_kv_blocks == load.total_kv_blocks


def _abort_then_close(dec, call, outbox) -> None:
    seen: set[str] = set()
    for out in call:
        seen |= {o.request_id for o in out.outputs}
        if seen == {"long0", "long1"}:
            break
    assert dec.Health(common_pb2.HealthRequest(), timeout=10).load.running == 2
    outbox.put(decode_pb2.SessionRequest(abort_request_id="long0"))
    deadline = time.monotonic() + 10
    while dec.Health(common_pb2.HealthRequest(), timeout=10).load.running != 1:
        assert time.monotonic() < deadline, "abort over the session did not stop long0"
        time.sleep(0.05)
    # long0 says nothing more after its abort (steps already on the wire may still
    # carry it, then never again; gRPC may have buffered many steps by now)
    rids = [{o.request_id for o in out.outputs}
            for out, _ in zip(call, range(300), strict=False)]
    last_long0 = max((i for i, r in enumerate(rids) if "long0" in r), default=-1)
    assert last_long0 < 250 and all(r == {"long1"} for r in rids[last_long0 + 1:])
    call.cancel()  # the gateway went away: long1 is aborted and every block is free
