"""Graceful drain: SIGTERM to one of two decode instances while 16 streams run. It is
marked draining at once (the gateway sends it nothing new), lets what it can finish,
and what is still running at its --shutdown-timeout continues on the other instance:
all 16 clients get exactly the uninterrupted text, and the instance exits."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.infra.launcher import Service
from pdmesh.shared.infra.registry import Registry
from tests.mesh import stop_all

ENGINE = ["--device", "cpu", "--dtype", "float32", "--block-size", "16",
          "--pool-segment-mb", "64"]
MODEL = "tiny"
PROMPTS = [list(range(300 + 17 * i, 330 + 17 * i)) for i in range(16)]
NEW = 96


@pytest.fixture(scope="module")
def expected(qwen3_path):
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def test_sigterm_to_a_decode_instance_loses_no_stream(qwen3_path, expected, tmp_path,
                                                        registry_prefix):
    prefix = registry_prefix + "-drain"
    reg = ["--registry-prefix", prefix]
    started: list[Service] = []
    try:
        kv = Service("kvstore", ["kvstore", *reg], tmp_path)
        started.append(kv)
        base = [str(qwen3_path), "--kvstore", kv.address, "--served-model-name", MODEL,
                *ENGINE, *reg]
        started.append(Service("prefill", ["prefill", *base], tmp_path))
        # the one to be rolled drains briefly: some streams outlive it and move over
        victim = Service("decode", ["decode", *base, "--shutdown-timeout", "0.5"], tmp_path)
        started.append(victim)
        started.append(Service("decode", ["decode", *base], tmp_path))
        gw = Service("gateway", ["gateway", str(qwen3_path), "--port", "0",
                                 "--served-model-name", MODEL, *reg], tmp_path)
        started.append(gw)
        client = openai.OpenAI(base_url=gw.info["http"] + "/v1", api_key="x", max_retries=0,
                               timeout=120)
        streaming = threading.Semaphore(0)

        def one(prompt: list[int]) -> str:
            text, first = "", True
            for chunk in client.completions.create(model=MODEL, prompt=prompt,
                                                   max_tokens=NEW, temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True}):
                if chunk.choices:
                    text += chunk.choices[0].text
                    if first and chunk.choices[0].text:
                        first = False
                        streaming.release()
            return text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(one, p) for p in PROMPTS]
            for _ in PROMPTS:  # every stream has started before the roll
                assert streaming.acquire(timeout=60)
            os.killpg(victim.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + 5
            draining = False
            while time.monotonic() < deadline and not draining:
                found = {i.address: i for i in Registry(prefix=prefix).instances("decode")}
                entry = found.get(victim.address)
                draining = entry is None or entry.draining
                time.sleep(0.05)
            assert draining, "the instance was not marked draining in the registry"
            got = [f.result(timeout=180) for f in futures]
        assert got == expected
        assert victim.proc.wait(30) == 0  # it exited by itself, cleanly
        assert victim.address not in {i.address for i in
                                      Registry(prefix=prefix).instances("decode")}
        metrics = httpx.get(gw.info["http"] + "/metrics", timeout=10).text
        print([ln for ln in metrics.splitlines() if ln.startswith("pdmesh_requests_migrated")])
    finally:
        stop_all(started)
