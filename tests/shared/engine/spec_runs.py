"""What the speculative-decoding tests share: a run of the offline engine, prompts of
mixed kinds, and the check that no KV block is left held."""

from __future__ import annotations

import random

from pdmesh.shared.engine import LLM


def mixed_prompts(n: int, seed: int = 0, longest: int = 90) -> list[list[int]]:
    """Random token ids (4 to ``longest``), every third a short motif repeated (up to
    ``longest`` + 30 tokens), so that even a random draft head is now and then right."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 3 == 2:
            motif = [rng.randrange(10, 900) for _ in range(rng.randrange(2, 9))]
            out.append((motif * 60)[:rng.randrange(8, longest + 30)])
        else:
            out.append([rng.randrange(10, 4000) for _ in range(rng.randrange(4, longest))])
    return out


def run(model, ps, params, **engine) -> tuple[list[list[int]], LLM]:
    """Generate ``ps`` on a fresh CPU engine; (each output's tokens, the engine)."""
    llm = LLM(str(model), device="cpu", block_size=16, **engine)
    outs = llm.generate(ps, params)
    return [o.outputs[0].token_ids for o in outs], llm


def assert_no_block_held(llm: LLM) -> None:
    for free, usable in llm.engine.kv.usage().values():
        assert free == usable
