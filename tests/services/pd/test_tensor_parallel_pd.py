"""Prefill and decode instances at different tensor-parallel sizes, as real processes
with KV through the real Mooncake pool: a TP2 prefill's blocks serve a TP1 decode, a TP1
prefill's a TP2 decode, each answering as one offline engine does, no prompt token
computed on decode."""

from __future__ import annotations

import grpc
import pytest

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.infra.launcher import Service
from pdmesh.shared.proto import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from pdmesh.shared.runtime.proto_convert import sampling_to_proto
from tests.mesh import stop_all
from tests.services.pd.session import OneRequest, prefill

PROMPTS = [list(range(200, 247)), list(range(300, 332)), [7, 8, 9]]
NEW = 8
ENGINE = ["--device", "cpu", "--dtype", "float32", "--block-size", "16",
          "--pool-segment-mb", "64"]


@pytest.fixture(scope="module")
def instances(qwen3_path, tmp_path_factory, registry_prefix):
    logs = tmp_path_factory.mktemp("tp-pd-logs")
    reg = ["--registry-prefix", f"{registry_prefix}-tp"]
    started: list[Service] = []
    try:
        kv = Service("kvstore", ["kvstore", *reg], logs)
        started.append(kv)
        found = {}
        for role in ("prefill", "decode"):
            for tp in (1, 2):
                s = Service(role, [role, "--model", str(qwen3_path), "--kvstore", kv.address,
                                   "--tensor-parallel-size", str(tp), *ENGINE, *reg], logs,
                            wait=False)
                started.append(s)
                found[role, tp] = s
        for s in started[1:]:  # (loading side by side)
            s.wait_ready()
        yield found
    finally:
        stop_all(started)


def prompts(decode_tp: int) -> list[list[int]]:
    """Prompts of their own per direction: the pool must not hold them from the other."""
    return [[t + 40 * decode_tp for t in p] for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(qwen3_path):
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    return {tp: [o.outputs[0].token_ids for o in llm.generate(prompts(tp), greedy)]
            for tp in (1, 2)}


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_kv_moves_between_tensor_parallel_sizes(instances, expected, prefill_tp, decode_tp):
    pre = prefill_pb2_grpc.PrefillStub(
        grpc.insecure_channel(instances["prefill", prefill_tp].address))
    dec = decode_pb2_grpc.DecodeStub(
        grpc.insecure_channel(instances["decode", decode_tp].address))
    sp = sampling_to_proto(SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    for i, prompt in enumerate(prompts(decode_tp)):
        r = prefill(pre, prefill_pb2.PrefillRequest(request_id=f"p{prefill_tp}-{i}",
                                                   prompt_token_ids=prompt, sampling=sp),
                    timeout=120)
        tokens, cached = [r.first_token], None
        for chunk in OneRequest(dec, decode_pb2.GenerateRequest(
                request_id=f"d{decode_tp}-{i}", prompt_token_ids=prompt,
                output_token_ids=[r.first_token], block_keys=r.block_keys, sampling=sp),
                timeout=120):
            cached = chunk.num_cached_tokens if cached is None else cached
            tokens += list(chunk.token_ids)
        assert cached == len(prompt)  # every prompt token came from the pool
        assert tokens == expected[decode_tp][i]
