"""The gateway's Answer over an in-process journey: what it reports of how a request
ended (stop_reason as vLLM reports it)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from pdmesh.services.gateway.answer import Answer
from pdmesh.services.gateway.metrics import GatewayMetrics
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.models.tokenizer import Tokenizer
from pdmesh.shared.runtime.protocol import TokenDelta


def answered(tok: Tokenizer, deltas: list[TokenDelta], eos: tuple[int, ...],
             **params) -> dict:
    async def journey():
        for d in deltas:
            yield d

    async def run() -> dict:
        a = Answer("r1", "tiny", False, [40, 41], SamplingParams(**params), [], tok,
                   GatewayMetrics("tiny"), eos_token_ids=eos)
        await a.start(journey())
        return await a.whole()

    return asyncio.run(run())["choices"][0]


@pytest.mark.parametrize("last,stop_token_ids,want", [
    ("other", [], "other"),  # generation_config's extra end of sequence: its id
    ("eos", [], None),  # the tokenizer's end of sequence: none (vLLM's), wherever listed
    ("stop", [300], 300),  # a stop token id: its id
])
def test_stop_reason_names_the_token_that_stopped_it(qwen3_path, last, stop_token_ids, want):
    tok = Tokenizer(qwen3_path)
    other = tok.encode("<|endoftext|>", add_special_tokens=False)[0]
    ids = {"other": other, "eos": tok.eos_token_id, "stop": 300}
    want = ids.get(want, want)
    choice = answered(tok, [TokenDelta("r1", [50]),
                            TokenDelta("r1", [ids[last]], finish_reason="stop")],
                      (other, tok.eos_token_id), max_tokens=8,  # (config.json's order)
                      stop_token_ids=stop_token_ids)
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", want)
    assert choice["text"] == tok.decode([50])  # the stopping token is not text


@pytest.mark.parametrize("interval", [1, 3])
def test_stream_interval_holds_tokens_until_that_many_are_in(qwen3_path, interval):
    """--stream-interval N: the first token goes out at once, then chunks of N tokens
    (the last chunk what is left), the text whole."""
    tok = Tokenizer(qwen3_path)
    ids = tok.encode("the quick brown fox jumps over the lazy dog and on",
                     add_special_tokens=False)[:8]  # 8 tokens, one per engine step
    assert len(ids) == 8
    deltas = [TokenDelta("r1", [t]) for t in ids[:-1]] + \
        [TokenDelta("r1", [ids[-1]], finish_reason="length")]

    async def journey():
        for d in deltas:
            yield d

    async def run() -> list[dict]:
        a = Answer("r1", "tiny", False, [40, 41], SamplingParams(max_tokens=8), [], tok,
                   GatewayMetrics("tiny"), stream_interval=interval)
        a.shape = dataclasses.replace(a.shape, token_ids=True)
        await a.start(journey())
        return [json.loads(e[len("data: "):]) for e in [x async for x in a.sse(False)]
                if e.startswith("data: {")]

    chunks = asyncio.run(run())
    sizes = [len(c["choices"][0]["token_ids"]) for c in chunks][:-1]  # (the finish chunk)
    assert sizes == ([1] * 8 if interval == 1 else [1, 3, 3, 1])
    assert "".join(c["choices"][0]["text"] for c in chunks) == tok.decode(ids)
