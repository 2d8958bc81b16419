"""`pdmesh generate`: offline generation with the engine, from the command line."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any


def run(a: Any) -> int:
    """``a``: the ServeConfig (its flags read as attributes)."""
    from pdmesh.shared.config.engine_config import engine_config
    from pdmesh.shared.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**asdict(engine_config(a.flags)))
    ready = time.perf_counter() - t0
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            max_tokens=a.max_tokens, seed=a.sampling_seed)
    prompts = a.prompt or ["Hello"]
    if a.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                   for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    took = time.perf_counter() - t0
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    for o in outs:
        c = o.outputs[0]
        print(f"--- prompt: {o.prompt!r}\n{c.text!r}\n[{len(c.token_ids)} tokens, "
              f"finish_reason={c.finish_reason}]")
    print(f"engine ready in {ready:.2f}s on {llm.engine.device}; {ntok} tokens in "
          f"{took:.2f}s ({ntok / took:.0f} tok/s)")
    return 0
