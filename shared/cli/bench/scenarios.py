"""Serving scenarios for `pdmesh bench serve`: who asks what, when.

A scenario is a list of sessions; a session starts at an offset (seconds from the run's
start) and asks one or more turns in order, each turn's prompt sent once the previous
answer has streamed back (multi-turn chat). Token ids are random (seeded), so every
server - pdmesh or vLLM - gets the very same requests.

The shapes follow published serving traces, scaled to what a small CPU box serves
(``max_context``, default 4,096 tokens):

- ``short-chat``: ShareGPT-like chat (vLLM's serving benchmarks; DistServe's chatbot):
  log-normal prompt and answer lengths, medians ~200 and ~150 tokens, steady Poisson rate.
- ``long-mixed``: long-context requests with a wide spread (Mooncake's Kimi trace: long
  inputs, short outputs; Splitwise's coding trace): prompts log-uniform over
  [max_context / 8, 3/4 max_context], answers 32-256, steady Poisson rate, so long
  prompts arrive while others decode.
- ``burst``: ``burst_size`` requests at once every ``burst_interval_s`` (prompts
  128-1,024, answers 64-256).
- ``shared-prefix``: a few long system prompts (``num_prefixes``, max_context / 4 to
  / 2 tokens) each request extends with 32-256 tokens of its own (vLLM's
  prefix-repetition dataset; agents and RAG), answers 64-128.
- ``multi-turn``: conversations of 2-6 turns, each turn's prompt the previous prompt, its
  answer and 32-256 new tokens (ShareGPT conversations; Mooncake's prefix reuse), answers
  32-192, conversations arriving at the Poisson rate.
- ``long-output``: short prompts (64-256) and long answers (512-1,024), steady rate.
- ``agent``: agents re-sending long histories (SWE-agent, tool loops; Mooncake's and
  LMCache's multi-turn traces): each session opens with a context of its own
  (log-uniform over [max_context / 4, max_context / 2]: files, tool output) and asks
  ``turns`` turns (default 8), each the history so far, its answers and 32-256 new
  tokens, answers 32-128; sessions run side by side, so between two turns of one the
  others' histories pass through the cache (a working set of sessions x max_context).
- ``random``: ``input_len`` in, ``output_len`` out for every request (the old default).

Arrivals: Poisson at ``request_rate`` (``inf``: every session at once, the box full), or
``arrival="burst"`` for any scenario: ``burst_size`` sessions at once every
``burst_interval_s`` (the ``burst`` scenario always arrives so).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

SCENARIOS = ("random", "short-chat", "long-mixed", "burst", "shared-prefix", "multi-turn",
             "long-output", "agent")
ARRIVALS = ("poisson", "burst")


@dataclass
class Turn:
    prompt: list[int]
    output_len: int


@dataclass
class Session:
    start_s: float  # offset from the run's start
    turns: list[Turn]


@dataclass
class ScenarioArgs:
    scenario: str = "random"
    num_prompts: int = 64  # requests (sessions for multi-turn)
    request_rate: float = math.inf  # sessions per second (Poisson); inf: all at once
    input_len: int = 128  # random only
    output_len: int = 128  # random only
    max_context: int = 4096  # prompt + answer fit in this
    vocab_size: int = 4000
    seed: int = 0
    burst_size: int = 16
    burst_interval_s: float = 10.0
    num_prefixes: int = 4
    arrival: str = "poisson"  # or "burst" (the burst scenario's always)
    turns: int = 8  # agent only


def build(a: ScenarioArgs) -> list[Session]:
    """The sessions of scenario ``a.scenario``, deterministic by ``a.seed``."""
    if a.scenario not in SCENARIOS:
        raise ValueError(f"scenario: must be one of {', '.join(SCENARIOS)}, "
                         f"got {a.scenario!r}")
    if a.num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {a.num_prompts}")
    if a.max_context < 64:
        raise ValueError(f"max_context: must be >= 64, got {a.max_context}")
    if a.turns < 1:
        raise ValueError(f"turns: must be >= 1, got {a.turns}")
    if a.arrival not in ARRIVALS:
        raise ValueError(f"arrival: must be one of {', '.join(ARRIVALS)}, got {a.arrival!r}")
    rng = random.Random(a.seed)
    build_one = {
        "random": _random, "short-chat": _short_chat, "long-mixed": _long_mixed,
        "burst": _burst_shape, "shared-prefix": _shared_prefix(a, rng),
        "multi-turn": _multi_turn, "long-output": _long_output, "agent": _agent,
    }[a.scenario]
    # arrival times from their own draws: the same seed, the same requests, however they
    # arrive (paced, all at once or in bursts)
    starts = (_bursts(a) if "burst" in (a.scenario, a.arrival)
              else _poisson(a, random.Random(f"{a.seed}-arrivals")))
    return [Session(t, build_one(a, rng)) for t in starts]


def reusable_prefix_tokens(sessions: list[Session]) -> tuple[int, int]:
    """(prompt tokens a perfect, unbounded prefix cache would serve, all prompt tokens):
    for each prompt, the longest prefix it shares with a prompt sent before it (sessions
    in start order, a session's turns in order), less the one token every prompt
    computes. The ceiling for the prefix-cache hit rate the servers report."""
    seen: set[int] = set()
    reusable = total = 0
    for s in sorted(sessions, key=lambda s: s.start_s):
        for t in s.turns:
            h, hit, matching = 0, 0, True
            for i, tok in enumerate(t.prompt):
                h = hash((h, tok))
                if matching and h in seen:
                    hit = i + 1
                else:
                    matching = False
                    seen.add(h)
            reusable += min(hit, len(t.prompt) - 1)
            total += len(t.prompt)
    return reusable, total


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def _fit(a: ScenarioArgs, prompt_len: int, output_len: int) -> tuple[int, int]:
    """Clip a request to the context: the answer first keeps at least 1 token."""
    output_len = max(1, min(output_len, a.max_context // 2))
    return max(1, min(prompt_len, a.max_context - output_len)), output_len


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _one(a: ScenarioArgs, rng: random.Random, prompt_len: int, output_len: int) -> list[Turn]:
    p, o = _fit(a, prompt_len, output_len)
    return [Turn(tokens(rng, p, a.vocab_size), o)]


def _random(a: ScenarioArgs, rng: random.Random) -> list[Turn]:
    return _one(a, rng, a.input_len, a.output_len)


def _short_chat(a: ScenarioArgs, rng: random.Random) -> list[Turn]:
    return _one(a, rng, _lognormal(rng, 200, 0.8, 8, 1024), _lognormal(rng, 150, 0.7, 8, 512))


def _long_mixed(a: ScenarioArgs, rng: random.Random) -> list[Turn]:
    lo, hi = max(16, a.max_context // 8), max(32, 3 * a.max_context // 4)
    return _one(a, rng, _log_uniform(rng, lo, hi), rng.randint(32, 256))


def _burst_shape(a: ScenarioArgs, rng: random.Random) -> list[Turn]:
    return _one(a, rng, rng.randint(128, 1024), rng.randint(64, 256))


def _long_output(a: ScenarioArgs, rng: random.Random) -> list[Turn]:
    return _one(a, rng, rng.randint(64, 256), rng.randint(512, 1024))


def _shared_prefix(a: ScenarioArgs, rng: random.Random):
    prefixes = [tokens(rng, rng.randint(a.max_context // 4, a.max_context // 2), a.vocab_size)
                for _ in range(max(1, a.num_prefixes))]

    def one(a: ScenarioArgs, rng: random.Random) -> list[Turn]:
        prefix = rng.choice(prefixes)
        p, o = _fit(a, len(prefix) + rng.randint(32, 256), rng.randint(64, 128))
        own = tokens(rng, max(0, p - len(prefix)), a.vocab_size)
        return [Turn((prefix + own)[:p], o)]

    return one


def _multi_turn(a: ScenarioArgs, rng: random.Random) -> list[Turn]:
    return _turns(a, rng, [], rng.randint(2, 6), 192) or _one(a, rng, 64, 64)


def _agent(a: ScenarioArgs, rng: random.Random) -> list[Turn]:
    context = tokens(rng, _log_uniform(rng, max(8, a.max_context // 4),
                                       max(16, a.max_context // 2)), a.vocab_size)
    return _turns(a, rng, context, a.turns, 128) or _one(a, rng, len(context), 32)


def _turns(a: ScenarioArgs, rng: random.Random, history: list[int], count: int,
           longest_answer: int) -> list[Turn]:
    """Up to ``count`` turns after ``history``, each the history so far, its answers
    and 32-256 new tokens, answered in 32-``longest_answer`` tokens; as many as fit the
    context."""
    turns: list[Turn] = []
    for _ in range(count):
        user = tokens(rng, rng.randint(32, 256), a.vocab_size)
        out = rng.randint(32, longest_answer)
        if len(history) + len(user) + out > a.max_context:
            break
        prompt = history + user
        turns.append(Turn(prompt, out))
        # the next turn carries this answer (stand-in ids: the server's answer is text)
        history = prompt + tokens(rng, out, a.vocab_size)
    return turns


def _poisson(a: ScenarioArgs, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    for _ in range(a.num_prompts):
        out.append(t)
        if a.request_rate != math.inf:
            t += rng.expovariate(a.request_rate)
    return out


def _bursts(a: ScenarioArgs) -> list[float]:
    size = max(1, a.burst_size)
    return [(i // size) * a.burst_interval_s for i in range(a.num_prompts)]


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (ms), as vLLM's
    ``--goodput``; keys ttft, tpot, e2el."""
    out = {}
    for spec in specs:
        key, sep, value = spec.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not sep:
            raise ValueError(f"--goodput: expected ttft:MS, tpot:MS or e2el:MS, got {spec!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {spec!r}: {value!r} is not a number of ms") from None
        if not (math.isfinite(ms) and ms > 0):
            raise ValueError(f"--goodput: {spec!r}: must be a positive number of ms")
        out[key] = ms
    return out
