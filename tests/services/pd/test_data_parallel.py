"""A decode instance of two data-parallel ranks with expert parallelism, as real
processes behind the gateway: every answer equals the single-process engine's, LoRA
adapters' answers are transformers + PEFT's, both ranks serve, and stopping the instance
stops every rank."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.infra.launcher import Service
from pdmesh.shared.infra.registry import Registry
from tests.mesh import stop_all
from tests.processes import alive
from tests.services.pd.lora_mesh import mixed_batch

ENGINE = ["--device", "cpu", "--dtype", "float32", "--block-size", "16",
          "--pool-segment-mb", "64"]
MODEL = "tiny-moe"
PROMPTS = [list(range(100 + 7 * i, 130 + 11 * i)) for i in range(8)]
NEW = 10


@contextmanager
def moe_mesh(model: str, logs: Path, prefix: str, prefill: list[str], decode: list[str]
             ) -> Iterator[dict]:
    """A kvstore, a prefill instance, a decode instance and the gateway serving ``model``
    as MODEL, each instance with its own extra flags; stopped on the way out."""
    reg = ["--registry-prefix", prefix]
    started: list[Service] = []
    try:
        kv = Service("kvstore", ["kvstore", *reg], logs)
        started.append(kv)
        started.append(Service("prefill", ["prefill", model, "--kvstore", kv.address,
                                           "--served-model-name", MODEL, *prefill, *ENGINE,
                                           *reg], logs, wait=False))
        dec = Service("decode", ["decode", model, "--kvstore", kv.address,
                                 "--served-model-name", MODEL, *decode, *ENGINE, *reg], logs,
                      wait=False)
        started.append(dec)
        for s in started[1:]:  # (loading side by side)
            s.wait_ready()
        gw = Service("gateway", ["gateway", model, "--port", "0", "--served-model-name", MODEL,
                                 *reg], logs)
        started.append(gw)
        yield {"url": gw.info["http"], "decode": dec, "prefix": prefix}
    finally:
        stop_all(started)


@pytest.fixture(scope="module")
def mesh(tiny_models, tmp_path_factory, registry_prefix):
    lora = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "8"]
    with moe_mesh(str(tiny_models["qwen3_moe"]), tmp_path_factory.mktemp("dp-logs"),
                  registry_prefix + "-dp", lora,
                  ["--data-parallel-size", "2", "--enable-expert-parallel", *lora]) as m:
        yield m


def offline_answers(model: str) -> list[str]:
    """PROMPTS through the single-process engine."""
    llm = LLM(model, device="cpu", dtype="float32", block_size=16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def concurrent_answers(url: str) -> list[str]:
    """PROMPTS through the gateway at ``url``, all at once."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)

    def one(prompt):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW,
                                      temperature=0, extra_body={"ignore_eos": True})
        return r.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


@pytest.fixture(scope="module")
def expected(tiny_models):
    return offline_answers(str(tiny_models["qwen3_moe"]))


def test_both_ranks_register_as_decode_instances(mesh):
    decode = Registry(prefix=mesh["prefix"]).instances("decode")
    assert sorted((i.dp_rank, i.dp_size) for i in decode) == [(0, 2), (1, 2)]
    assert sorted(i.address for i in decode) == sorted(mesh["decode"].info["ranks"])


def test_concurrent_requests_equal_the_single_process_engine(mesh, expected):
    assert concurrent_answers(mesh["url"]) == expected


def test_a_batch_mixing_three_adapters_and_the_base_matches_peft(mesh, tiny_models, tmp_path):
    """Qwen3-MoE: three adapters loaded at runtime on the prefill instance and both DP
    ranks, and the base model, in one batch through the mesh: PEFT's tokens."""
    got, want = mixed_batch(mesh["url"], MODEL, tiny_models["qwen3_moe"], "qwen3_moe",
                            tmp_path)
    assert len({str(want[k]) for k in (0, 3, 4)}) == 3  # each adapter tells
    assert got == want


def test_stopping_the_instance_stops_every_rank(mesh):
    pids = mesh["decode"].info["pids"]
    assert all(alive(p) for p in pids)
    mesh["decode"].stop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)
