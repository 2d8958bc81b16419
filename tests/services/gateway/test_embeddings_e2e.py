"""POST /v1/embeddings from pooling instances (--runner pooling on a prefill instance,
SGLang's --is-embedding on a mixed one): the embeddings an offline pooling engine gives,
as floats or base64; a field the request cannot have is a 400 naming it; generation is
refused by a model that only pools, as vLLM refuses it."""

from __future__ import annotations

import base64
import struct

import grpc
import httpx
import pytest

from pdmesh.services.gateway.embeddings import _refuse_generating
from pdmesh.shared.engine import LLM
from pdmesh.shared.infra.launcher import Service
from pdmesh.shared.infra.registry import Instance
from pdmesh.shared.proto import common_pb2, decode_pb2_grpc
from tests.mesh import stop_all

ENGINE = ["--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32",
          "--block-size", "16"]


def test_embeddings_from_pooling_instances(qwen3_path, tmp_path, registry_prefix):
    reg = ["--registry-prefix", registry_prefix + "-embed"]
    mean = '{"pooling_type": "MEAN"}'
    started: list[Service] = []
    try:
        kv = Service("kvstore", ["kvstore", *reg], tmp_path)
        started.append(kv)
        engines = [Service("prefill", ["prefill", str(qwen3_path), "--runner", "pooling",
                                       "--pooler-config", mean, "--kvstore", kv.address,
                                       "--pool-segment-mb", "64", *ENGINE, *reg],
                           tmp_path, wait=False),
                   Service("mixed", ["mixed", str(qwen3_path), "--is-embedding",
                                     "--pooler-config", mean, *ENGINE, *reg],
                           tmp_path, wait=False)]
        started += engines
        for s in engines:
            s.wait_ready()
        gw = Service("gateway", ["gateway", str(qwen3_path), "--port", "0",
                                 "--served-model-name", "tiny", *reg], tmp_path)
        started.append(gw)
        url = gw.info["http"] + "/v1/embeddings"
        texts = ["hello world", "the quick brown fox jumps over the lazy dog"]
        tokens = [httpx.post(gw.info["http"] + "/tokenize", json={"prompt": t},
                             timeout=30).json()["tokens"] for t in texts]
        offline = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16,
                      runner="pooling", pooler_config={"pooling_type": "MEAN"})
        expected = [o.outputs.embedding for o in offline.embed(tokens)]

        r = httpx.post(url, json={"model": "tiny", "input": texts}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
        assert body["usage"]["prompt_tokens"] == sum(map(len, tokens))
        for d, want in zip(body["data"], expected, strict=True):
            assert d["object"] == "embedding"
            assert d["embedding"] == pytest.approx(want, abs=1e-5)
        # token ids, as base64 float32
        r = httpx.post(url, json={"input": tokens[1], "encoding_format": "base64"},
                       timeout=60)
        assert r.status_code == 200, r.text
        raw = base64.b64decode(r.json()["data"][0]["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(
            expected[1], abs=1e-5)
        # vLLM 0.32's use_activation (off: the mean itself), its embed_dtype and endianness
        raw_mean = httpx.post(url, json={"input": tokens[1], "use_activation": False},
                              timeout=60).json()["data"][0]["embedding"]
        norm = sum(x * x for x in raw_mean) ** 0.5
        assert [x / norm for x in raw_mean] == pytest.approx(expected[1], abs=1e-5)
        r = httpx.post(url, json={"input": tokens[1], "encoding_format": "base64",
                                  "embed_dtype": "float16", "endianness": "big"}, timeout=60)
        raw = base64.b64decode(r.json()["data"][0]["embedding"])
        assert list(struct.unpack(f">{len(raw) // 2}e", raw)) == pytest.approx(
            expected[1], abs=1e-3)
        # the mixed instance answers the same call (the gateway picked the prefill one)
        with grpc.insecure_channel(engines[1].address) as ch:
            got = decode_pb2_grpc.DecodeStub(ch).Embed(
                common_pb2.EmbedRequest(request_id="direct", prompt_token_ids=tokens[0]),
                timeout=60)
        assert list(got.embedding) == pytest.approx(expected[0], abs=1e-5)

        for bad, field in (({"input": []}, "input"), ({"input": [[1, 2], [10**7]]}, "input"),
                           ({"input": "x", "normalize": True}, "normalize"),
                           ({"input": "x", "dimensions": 8}, "dimensions"),
                           ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                           ({"input": "x", "model": "other"}, "model")):
            r = httpx.post(url, json=bad, timeout=30)
            assert r.status_code in (400, 404), (bad, r.text)
            assert r.json()["error"]["param"] == field or field in r.json()["error"][
                "message"], (bad, r.text)
        r = httpx.post(gw.info["http"] + "/v1/completions",
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 400 and "pooling runner" in r.text, r.text
        assert httpx.get(gw.info["http"] + "/health", timeout=10).json()["pooling"] == 2
    finally:
        stop_all(started)


class _Router:
    def __init__(self, instances: list[Instance]):
        self._all = instances

    def instances(self, role: str, runner: str = "generate") -> list[Instance]:
        return [i for i in self._all if i.role == role and i.runner == runner]


def test_a_model_that_only_generates_has_no_embeddings_api():
    gen = Instance("a", "mixed", "127.0.0.1:1")
    refused = _refuse_generating(_Router([gen]))
    assert refused is not None and refused.status_code == 400
    assert b"does not support the Embeddings API" in refused.body
    assert _refuse_generating(_Router([])).status_code == 503
    assert _refuse_generating(_Router([gen, Instance("b", "prefill", "127.0.0.1:2",
                                                     runner="pooling")])) is None
