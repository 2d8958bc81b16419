"""What the speculative-decoding tests share: a run of the offline engine, and the check
that no KV block is left held."""

from __future__ import annotations

from pdmesh.shared.engine import LLM


def run(model, ps, params, **engine) -> tuple[list[list[int]], LLM]:
    """Generate ``ps`` on a fresh CPU engine; (each output's tokens, the engine)."""
    llm = LLM(str(model), device="cpu", block_size=16, **engine)
    outs = llm.generate(ps, params)
    return [o.outputs[0].token_ids for o in outs], llm


def assert_no_block_held(llm: LLM) -> None:
    for free, usable in llm.engine.kv.usage().values():
        assert free == usable
