"""`pdmesh bench serve`: load an OpenAI-compatible endpoint like `vllm bench serve`.

``--scenario`` picks who asks what and when (``scenarios.py``: short chat, long
mixed-length prompts, bursts, shared prefixes, multi-turn chat, long outputs; ``random``:
``--input-len`` random token ids in, ``--output-len`` out for every request). Token ids
are seeded, answers stream with EOS ignored; sessions arrive as a Poisson process at
``--request-rate`` (inf: all at once), at most ``--max-concurrency`` requests in flight.
Reports output tok/s, request/s, TTFT, TPOT, ITL and end-to-end latency (median and
p99, ms), goodput under ``--goodput`` SLOs, and with ``--json`` writes them to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import socket
import sys
import time
from dataclasses import dataclass, field

import httpx

from pdmesh.shared.cli.bench.scenarios import (
    ARRIVALS,
    SCENARIOS,
    ScenarioArgs,
    Session,
    build,
    parse_goodput,
    reusable_prefix_tokens,
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--scenario", default="random", choices=SCENARIOS)
    p.add_argument("--num-prompts", type=int, default=64,
                   help="requests (multi-turn, agent: conversations)")
    p.add_argument("--input-len", type=int, default=128, help="random scenario")
    p.add_argument("--output-len", type=int, default=128, help="random scenario")
    p.add_argument("--max-context", type=int, default=4096,
                   help="prompt + answer fit in this many tokens (the server's context)")
    p.add_argument("--arrival", default="poisson", choices=ARRIVALS,
                   help="poisson: at --request-rate (inf: all at once); burst: --burst-size "
                        "at once every --burst-interval-s (the burst scenario's always)")
    p.add_argument("--burst-size", type=int, default=16, help="burst arrivals")
    p.add_argument("--burst-interval-s", type=float, default=10.0, help="burst arrivals")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix scenario")
    p.add_argument("--turns", type=int, default=8, help="agent scenario: turns per session")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs a request must meet to count as good: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=4000, help="token ids drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME",
                   help="LoRA adapters the server serves: each request asks for one of "
                        "them at random (seeded; a conversation keeps its own), as vLLM's "
                        "bench serve does")
    p.add_argument("--json", default=None)
    p.add_argument("--save-detailed", action="store_true",
                   help="--json also holds every request's start, TTFT, ITLs and token "
                        "counts (as vLLM's bench serve: to find stalls in time)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no requests-done line on stderr while running")


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details (None: not reported)
    error: str = ""
    start: float = 0.0  # seconds after the run's start the request was sent


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int],
               output_len: int, run_t0: float) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last = t0
    res = Result(ok=False, start=t0 - run_t0)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = event["error"]["message"]
                    return res
                if event.get("usage"):
                    usage = event["usage"]
                    res.output_tokens = usage["completion_tokens"]
                    res.prompt_tokens = usage.get("prompt_tokens") or 0
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens")
                if event.get("choices") and event["choices"][0].get("text"):
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        res.error = repr(e)
        return res
    res.latency = time.perf_counter() - t0
    res.ok = res.output_tokens > 0
    return res


def scenario_args(a: argparse.Namespace) -> ScenarioArgs:
    return ScenarioArgs(a.scenario, a.num_prompts, a.request_rate, a.input_len, a.output_len,
                        a.max_context, a.vocab_size, a.seed, a.burst_size, a.burst_interval_s,
                        a.num_prefixes, a.arrival, a.turns)


async def _run(a: argparse.Namespace) -> dict:
    sessions = build(scenario_args(a))
    total = sum(len(s.turns) for s in sessions)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    limits = httpx.Limits(max_connections=a.max_concurrency or total)
    sem = asyncio.Semaphore(a.max_concurrency or total)
    # TCP_NODELAY: httpx writes a request's headers and body separately, and Nagle's
    # algorithm would hold the body for the server's delayed ACK (~40 ms of fake TTFT)
    transport = httpx.AsyncHTTPTransport(
        limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    finished = itertools.count(1)
    pick = random.Random(a.seed)
    models = [pick.choice(a.lora_modules) if a.lora_modules else a.model for _ in sessions]

    def progress(done: int) -> None:
        if a.progress:
            print(f"\rrequests done {done}/{total}", end="", file=sys.stderr, flush=True)

    async with httpx.AsyncClient(base_url=a.base_url, headers=headers, transport=transport,
                                 timeout=httpx.Timeout(600)) as client:
        t0 = time.perf_counter()
        started_unix = time.time()

        async def session(s: Session, model: str) -> list[Result]:
            await asyncio.sleep(max(0.0, t0 + s.start_s - time.perf_counter()))
            out = []
            for turn in s.turns:  # a conversation's next turn waits for this answer
                async with sem:
                    out.append(await _one(client, model, turn.prompt, turn.output_len, t0))
                progress(next(finished))
                if not out[-1].ok:
                    break  # the conversation ends with its failed turn
            return out

        progress(0)
        per_session = await asyncio.gather(*(session(s, m)
                                             for s, m in zip(sessions, models, strict=True)))
        duration = time.perf_counter() - t0
        if a.progress:
            print(file=sys.stderr)
    results = [r for rs in per_session for r in rs]
    results += [Result(ok=False, error="not sent: an earlier turn of its conversation failed")
                for _ in range(total - len(results))]
    res = summarize(results, duration, a)
    if a.save_detailed:
        res["started_unix"] = started_unix  # (start_s counts from here)
        res["requests"] = [detail(r) for r in results]
    reusable, prompt_tokens = reusable_prefix_tokens(sessions)
    res["prefix_reusable_fraction"] = reusable / prompt_tokens
    return res


def detail(r: Result) -> dict:
    """One request as --save-detailed writes it (milliseconds; start in seconds)."""
    return {"ok": r.ok, "start_s": round(r.start, 6), "ttft_ms": round(r.ttft * 1e3, 3),
            "itl_ms": [round(x * 1e3, 3) for x in r.itls],
            "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
            "cached_tokens": r.cached_tokens, "error": r.error}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))] * 1e3


def summarize(results: list[Result], duration: float, a: argparse.Namespace) -> dict:
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    ttfts = [r.ttft for r in good]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    itls = [x for r in good for x in r.itls]
    e2els = [r.latency for r in good]
    slo = parse_goodput(getattr(a, "goodput", []) or [])
    meets = [r for r in good if _meets(r, slo)]
    # the servers' prefix caches (a mesh's: every instance's, and its pool) as the usage
    # reports them: cached prompt tokens over the prompt tokens of requests that say
    told = [r for r in good if r.cached_tokens is not None]
    told_prompt = sum(r.prompt_tokens for r in told)
    return {
        "completed": len(good), "failed": len(results) - len(good),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "output_tok_s": out_tokens / duration,
        "request_s": len(good) / duration,
        "ttft_ms_median": _pct(ttfts, 50), "ttft_ms_p99": _pct(ttfts, 99),
        "tpot_ms_median": _pct(tpots, 50), "tpot_ms_p99": _pct(tpots, 99),
        "itl_ms_median": _pct(itls, 50), "itl_ms_p99": _pct(itls, 99),
        "e2e_ms_median": _pct(e2els, 50), "e2e_ms_p99": _pct(e2els, 99),
        "goodput_slo_ms": slo,
        "goodput_request_s": len(meets) / duration if slo else None,
        "goodput_fraction": len(meets) / len(results) if slo and results else None,
        "prefix_hit_fraction": (sum(r.cached_tokens or 0 for r in told) / told_prompt
                                if told_prompt else None),
        "args": {k: v for k, v in vars(a).items() if k not in ("func", "api_key")},
    }


def _meets(r: Result, slo: dict[str, float]) -> bool:
    tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
    measured = {"ttft": r.ttft * 1e3, "tpot": tpot * 1e3, "e2el": r.latency * 1e3}
    return all(measured[k] <= ms for k, ms in slo.items())


def run(a: argparse.Namespace) -> int:
    try:
        build(scenario_args(a))  # bad arguments: a clear error before any request
        parse_goodput(a.goodput)
    except ValueError as e:
        print(f"pdmesh bench serve: {e}", file=sys.stderr)
        return 2
    res = asyncio.run(_run(a))
    print(f"completed {res['completed']}, failed {res['failed']} in {res['duration_s']:.2f}s | "
          f"output {res['output_tok_s']:.0f} tok/s, {res['request_s']:.2f} req/s\n"
          f"TTFT median {res['ttft_ms_median']:.2f} ms p99 {res['ttft_ms_p99']:.2f} | "
          f"TPOT median {res['tpot_ms_median']:.3f} ms p99 {res['tpot_ms_p99']:.3f} | "
          f"ITL median {res['itl_ms_median']:.3f} ms p99 {res['itl_ms_p99']:.3f} | "
          f"E2E median {res['e2e_ms_median']:.0f} ms p99 {res['e2e_ms_p99']:.0f}")
    if res["goodput_request_s"] is not None:
        slo = " ".join(f"{k}<={v:g}ms" for k, v in res["goodput_slo_ms"].items())
        print(f"goodput ({slo}): {res['goodput_request_s']:.2f} req/s, "
              f"{100 * res['goodput_fraction']:.0f}% of requests")
    hit = res["prefix_hit_fraction"]
    print(f"prefix cache: {'not reported' if hit is None else f'{100 * hit:.1f}%'} of "
          f"prompt tokens cached (a perfect cache: "
          f"{100 * res['prefix_reusable_fraction']:.1f}%)")
    for e in res["errors"]:
        print(f"error: {e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["failed"] == 0 else 1
