"""What structured output costs the engine: the same batch decoded free, under a JSON
schema, and under a regex, offline on one engine (the grammar's mask is computed on the
CPU for every request every step, then applied to the logits). Arms alternate A B C C B A
per round in one run (the machine is shared and noisy); the figures are decode tokens per
second (over the tokens each arm decoded: a grammar that completes ends its output
before --output-len) and each arm's ratio to "free" in the same round.

    .venv/bin/python scripts/bench_structured.py --model /tmp/bench/qwen3 \\
        [--batch 16] [--output-len 128] [--rounds 2] [--out structured.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.engine.structured import json_schema_grammar, regex_grammar

# a schema whose strings are long enough to run to the end of the output
SCHEMA = {"type": "object", "required": ["items"], "properties": {"items": {
    "type": "array", "items": {"type": "object", "required": ["name", "note"],
                               "properties": {"name": {"type": "string"},
                                              "note": {"type": "string"}}}}}}
ARMS = {"free": None, "json_schema": json_schema_grammar(SCHEMA),
        "regex": regex_grammar(r"([a-z]+ [0-9]+, )+")}


def run(llm: LLM, prompts: list[list[int]], grammar: str | None, n: int
        ) -> tuple[float, float]:
    """(decode tokens per second, mean output length)."""
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=n, ignore_eos=True,
                            grammar=grammar)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    took = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / took, tokens / len(outs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out")
    a = p.parse_args()
    llm = LLM(a.model, device="cpu", dtype="float32", block_size=16)
    prompts = [[(7 * i + j) % 4000 + 10 for j in range(a.input_len)] for i in range(a.batch)]
    for grammar in ARMS.values():  # warm up: llguidance's tokenizer, the prompts' KV
        run(llm, prompts, grammar, 8)
    order = list(ARMS) + list(reversed(ARMS))
    rows: dict[str, list[float]] = {k: [] for k in ARMS}
    lengths: dict[str, float] = {}
    ratios: dict[str, list[float]] = {k: [] for k in ARMS}
    for _ in range(a.rounds):
        got = {k: [] for k in ARMS}
        for arm in order:
            rate, lengths[arm] = run(llm, prompts, ARMS[arm], a.output_len)
            got[arm].append(rate)
        for arm in ARMS:
            rows[arm] += got[arm]
            ratios[arm].append(statistics.mean(got[arm]) / statistics.mean(got["free"]))
    result = {arm: {"tokens_per_s": round(statistics.median(rows[arm]), 1),
                    "ratio_to_free": round(statistics.median(ratios[arm]), 3),
                    "mean_output_tokens": round(lengths[arm], 1)}
              for arm in ARMS}
    result["config"] = vars(a)
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
