"""Dynamic EPLB end to end, as real processes: a skewed MoE model on a decode instance
of two expert-parallel ranks, the EPLB controller, prefill, kvstore, gateway. The
controller's placement raises balancedness, the ranks apply it layer by layer while
requests run, every answer stays the single-process engine's, and killing the controller
leaves the instance serving."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import grpc
import httpx
import openai
import pytest

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.infra.launcher import Service
from pdmesh.shared.infra.registry import Registry
from pdmesh.shared.models.tiny import make_tiny_model
from pdmesh.shared.proto import eplb_pb2, eplb_pb2_grpc
from tests.mesh import stop_all
from tests.prometheus_text import sample

ENGINE = ["--device", "cpu", "--dtype", "float32", "--block-size", "16",
          "--pool-segment-mb", "64"]
MODEL = "skewed-moe"
# DeepSeek's policy: a whole new placement, weights moved onto every rank
EPLB = {"eplb_config": {"dynamic_eplb": True, "expert_heat_collection_interval": 64,
                        "num_redundant_experts": 2, "eplb_policy_type": 1}}
PROMPTS = [list(range(60 + 13 * i, 100 + 17 * i)) for i in range(6)]
NEW = 24


@pytest.fixture(scope="module")
def skewed(tmp_path_factory, bpe_tokenizer):
    return str(make_tiny_model(tmp_path_factory.mktemp("skewed") / "m", "qwen3_moe", seed=0,
                               tokenizer=bpe_tokenizer, expert_skew=0.3))


@pytest.fixture(scope="module")
def expected(skewed):
    llm = LLM(skewed, device="cpu", dtype="float32", block_size=16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def mesh(skewed, tmp_path_factory, registry_prefix):
    logs = tmp_path_factory.mktemp("eplb-logs")
    prefix = registry_prefix + "-eplb"
    reg = ["--registry-prefix", prefix]
    started: list[Service] = []
    try:
        ctl = Service("eplb", ["eplb", "--port", "0", "--interval-s", "0.5",
                               "--improvement-threshold", "0.02", *reg], logs)
        started.append(ctl)
        kv = Service("kvstore", ["kvstore", *reg], logs)
        started.append(kv)
        started.append(Service("prefill", ["prefill", skewed, "--kvstore", kv.address,
                                           "--served-model-name", MODEL, *ENGINE, *reg], logs,
                               wait=False))
        dec = Service("decode", ["decode", skewed, "--kvstore", kv.address,
                                 "--served-model-name", MODEL, "--data-parallel-size", "2",
                                 "--enable-expert-parallel", "--additional-config",
                                 json.dumps(EPLB), *ENGINE, *reg], logs, wait=False)
        started.append(dec)
        for s in started[2:]:  # (loading side by side)
            s.wait_ready()
        gw = Service("gateway", ["gateway", skewed, "--port", "0", "--served-model-name",
                                 MODEL, *reg], logs)
        started.append(gw)
        yield {"url": gw.info["http"], "controller": ctl, "prefix": prefix,
               "group": dec.info["eplb_group"], "decode": dec}
    finally:
        stop_all(started)


def ask(url: str, prompt: list[int]) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].text


def decode_versions(prefix: str) -> list[int]:
    return sorted(i.load.get("placement_version", 0)
                  for i in Registry(prefix=prefix).instances("decode"))


def test_controller_rebalances_while_answers_stay_exact(mesh, expected):
    url, prefix = mesh["url"], mesh["prefix"]
    stub = eplb_pb2_grpc.EplbStub(grpc.insecure_channel(mesh["controller"].address))
    wrong: list[tuple[int, str]] = []
    answered = 0
    stop = threading.Event()

    def traffic():  # requests keep running while the placement changes under them
        nonlocal answered
        while not stop.is_set():
            for i, p in enumerate(PROMPTS):
                got = ask(url, p)
                answered += 1
                if got != expected[i]:
                    wrong.append((i, got))

    published: list = []
    watch = stub.WatchPlacement(eplb_pb2.WatchRequest(group=mesh["group"]))

    def collect():
        try:
            for placement in watch:
                published.append(placement)
        except grpc.RpcError:
            pass  # cancelled at the end

    threading.Thread(target=collect, daemon=True).start()
    threads = [threading.Thread(target=traffic) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and min(decode_versions(prefix) or [0]) < 1:
            time.sleep(0.25)
        versions = decode_versions(prefix)
        time.sleep(1.0)  # more requests on the new placement
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert versions and min(versions) >= 1, f"the ranks never applied a placement: {versions}"
    assert not wrong, f"{len(wrong)} of {answered} answers changed: {wrong[:2]}"
    status = stub.Status(eplb_pb2.StatusRequest(group=mesh["group"]), timeout=10)
    assert sorted(status.ranks_reporting) == [0, 1]
    watch.cancel()
    first = next(p for p in published if p.version == 1)  # replaces the start placement
    before = sum(first.balancedness_before) / len(first.balancedness_before)
    after = sum(first.balancedness_after) / len(first.balancedness_after)
    print(f"balancedness before {before:.3f} after {after:.3f} "
          f"(versions published: {[p.version for p in published]})")
    assert after > before + 0.05
    moved = [i.load.get("expert_bytes_moved", 0)
             for i in Registry(prefix=prefix).instances("decode")]
    assert sum(moved) > 0
    # the same figures on /metrics: every rank's version and bytes, the controller's
    # per-layer balancedness of the placement in force
    for url in mesh["decode"].info["metrics"]:
        text = httpx.get(url, timeout=10).text
        assert sample(text, "pdmesh_eplb_placement_version") >= 1
        assert sample(text, "pdmesh_eplb_expert_weight_bytes_moved_total") > 0
    text = httpx.get(mesh["controller"].info["metrics"], timeout=10).text
    assert sample(text, "pdmesh_eplb_placement_version") >= 1
    assert 'placement="current"' in text and "pdmesh_eplb_balancedness{" in text


def test_instance_keeps_serving_without_its_controller(mesh, expected):
    ctl = mesh["controller"]
    os.killpg(ctl.proc.pid, signal.SIGKILL)
    ctl.proc.wait(10)
    assert [ask(mesh["url"], p) for p in PROMPTS[:3]] == expected[:3]
