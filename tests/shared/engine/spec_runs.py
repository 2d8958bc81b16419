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


def assert_hand_back_exact(llm: LLM, ps, params, want: list[list[int]]) -> None:
    """Run ``ps`` on ``llm`` (a recompute-scheduler engine that drafts) to the end: some
    request was handed back and drafts were verified; each output is the start of its
    greedy answer ``want`` (the whole of it where not handed back); no block held."""
    from pdmesh.shared.engine.request import RequestStatus

    reqs = [llm.engine.add_request(p, sp) for p, sp in zip(ps, params, strict=True)]
    while llm.engine.has_unfinished():
        llm.engine.step()
    handed = [r for r in reqs if r.status is RequestStatus.FINISHED_RECOMPUTED]
    assert handed and llm.engine.spec_stats.num_drafts > 0
    for r, full in zip(reqs, want, strict=True):
        assert r.output_token_ids == full[:len(r.output_token_ids)]
        if r.status is not RequestStatus.FINISHED_RECOMPUTED:
            assert r.output_token_ids == full
    assert_no_block_held(llm)
