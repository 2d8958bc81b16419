"""`pdmesh bench serve`: load an OpenAI-compatible endpoint like `vllm bench serve`.

Random dataset: each prompt is ``--input-len`` random token ids (seeded), each answer
``--output-len`` tokens with EOS ignored, streamed. Requests arrive as a Poisson process
at ``--request-rate`` (inf: all at once), at most ``--max-concurrency`` in flight.
Reports output tok/s, request/s, TTFT, TPOT and ITL (median and p99, ms) and, with
``--json``, writes them to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=4000, help="token ids drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no requests-done line on stderr while running")


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    error: str = ""


async def _one(client: httpx.AsyncClient, a: argparse.Namespace, prompt: list[int]) -> Result:
    body = {"model": a.model, "prompt": prompt, "max_tokens": a.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last = t0
    res = Result(ok=False)
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
                    res.output_tokens = event["usage"]["completion_tokens"]
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


async def _run(a: argparse.Namespace) -> dict:
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(10, a.vocab_size) for _ in range(a.input_len)]
               for _ in range(a.num_prompts)]
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    limits = httpx.Limits(max_connections=a.max_concurrency or a.num_prompts)
    sem = asyncio.Semaphore(a.max_concurrency or a.num_prompts)
    # TCP_NODELAY: httpx writes a request's headers and body separately, and Nagle's
    # algorithm would hold the body for the server's delayed ACK (~40 ms of fake TTFT)
    transport = httpx.AsyncHTTPTransport(
        limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    async with httpx.AsyncClient(base_url=a.base_url, headers=headers, transport=transport,
                                 timeout=httpx.Timeout(600)) as client:

        async def limited(p: list[int]) -> Result:
            async with sem:
                return await _one(client, a, p)

        def progress(done: int) -> None:
            print(f"\rrequests done {done}/{len(prompts)}", end="", file=sys.stderr,
                  flush=True)

        finished = itertools.count(1)
        tasks = []
        t0 = time.perf_counter()
        if a.progress:
            progress(0)
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if a.progress:
                tasks[-1].add_done_callback(lambda _: progress(next(finished)))
            if a.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(a.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if a.progress:
            print(file=sys.stderr)
    return summarize(results, duration, a)


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
    return {
        "completed": len(good), "failed": len(results) - len(good),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "output_tok_s": out_tokens / duration,
        "request_s": len(good) / duration,
        "ttft_ms_median": _pct(ttfts, 50), "ttft_ms_p99": _pct(ttfts, 99),
        "tpot_ms_median": _pct(tpots, 50), "tpot_ms_p99": _pct(tpots, 99),
        "itl_ms_median": _pct(itls, 50), "itl_ms_p99": _pct(itls, 99),
        "e2e_ms_median": statistics.median(r.latency for r in good) * 1e3 if good else 0.0,
        "args": {k: v for k, v in vars(a).items() if k not in ("func", "api_key")},
    }


def run(a: argparse.Namespace) -> int:
    res = asyncio.run(_run(a))
    print(f"completed {res['completed']}, failed {res['failed']} in {res['duration_s']:.2f}s | "
          f"output {res['output_tok_s']:.0f} tok/s, {res['request_s']:.2f} req/s\n"
          f"TTFT median {res['ttft_ms_median']:.2f} ms p99 {res['ttft_ms_p99']:.2f} | "
          f"TPOT median {res['tpot_ms_median']:.3f} ms p99 {res['tpot_ms_p99']:.3f} | "
          f"ITL median {res['itl_ms_median']:.3f} ms p99 {res['itl_ms_p99']:.3f}")
    for e in res["errors"]:
        print(f"error: {e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["failed"] == 0 else 1
