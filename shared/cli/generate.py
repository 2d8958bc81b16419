"""`pdmesh generate`: offline generation with the engine, from the command line."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict


def add_args(g: argparse.ArgumentParser) -> None:
    from pdmesh.shared.engine.args import add_engine_args

    add_engine_args(g)
    g.add_argument("--prompt", action="append", help="repeat for a batch")
    g.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None)


def run(a: argparse.Namespace) -> int:
    from pdmesh.shared.engine import LLM, SamplingParams
    from pdmesh.shared.engine.args import engine_config_from_args

    t0 = time.perf_counter()
    llm = LLM(**asdict(engine_config_from_args(a)))
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
