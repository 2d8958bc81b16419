"""LoRA through a running mesh: PEFT adapters loaded at runtime on every instance, then
one batch mixing them with the base model, sent at once through the gateway, against
transformers + PEFT's greedy tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.shared.engine.lora_reference import make_adapters, peft_greedy

NEW = 10
# (adapter index or None for the base model, prompt): two rows of one adapter, one
# prompt under two adapters and the base model
JOBS = [(0, list(range(100, 121))), (None, list(range(300, 307))),
        (1, list(range(2000, 2040))), (2, list(range(100, 121))),
        (None, list(range(100, 121))), (1, list(range(500, 530)))]


def mixed_batch(url: str, model: str, base: Path, arch: str, root: Path,
                stepwise: bool = False, api_key: str | None = None
                ) -> tuple[list[list[int]], list[list[int]]]:
    """(the mesh's tokens, PEFT's) for JOBS, three adapters of ranks 4, 8 (rsLoRA) and 2
    loaded at runtime as ``lora-{arch}-{i}``; the base model's rows ask for ``model``.
    (With fewer device slots than adapters, requests wait their turn.)"""
    shapes = [(4, 8.0, False), (8, 16.0, True), (2, 2.0, False)]
    paths = make_adapters(base, root, arch, shapes, seed=21)
    names = [f"lora-{arch}-{i}" for i in range(len(paths))]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for name, path in zip(names, paths, strict=True):
        r = httpx.post(url + "/v1/load_lora_adapter", timeout=60, headers=headers,
                       json={"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 200, r.text

    def ask(job: tuple[int | None, list[int]]) -> list[int]:
        index, prompt = job
        body = {"model": model if index is None else names[index], "prompt": prompt,
                "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(JOBS)) as pool:
        got = list(pool.map(ask, JOBS))
    return got, peft_greedy(base, paths, JOBS, NEW, stepwise=stepwise)
