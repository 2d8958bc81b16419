"""A soak: `pdmesh up` (or `serve`) under a steady mixed load with cancellations for a
stated time, each process's resident memory sampled as it goes (issue 41).

    .venv/bin/python scripts/bench_soak.py MODEL --minutes 10 --rate 1.5 \
        --out /tmp/soak.json

The load, the same for every run with one seed: requests arrive at ``--rate`` per second
(Poisson), prompts of 50 to 1,500 random token ids, 16 to 256 tokens out (ignore_eos),
half streamed; ``--cancel`` of the streams (15%) are dropped by their client after a
random 0.2-3 s. Every ``--every`` seconds each process of the mesh (gateway, engines and
their gRPC edges, kvstore, mooncake_master, redis) has its RSS read from /proc. The
report: each process's RSS once warm (after ``--warmup`` of the run) and at the end, and
the growth in between as % per hour; then each engine's largest resident mappings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scenarios import start_pdmesh, stop  # noqa: E402


def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree(root: int) -> dict[int, str]:
    """The processes under ``root`` (and it), by what they run."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(proc.name))
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        out[pid] = _label([c.decode(errors="replace") for c in cmd if c])
        todo += children.get(pid, [])
    return out


def _label(cmd: list[str]) -> str:
    text = " ".join(cmd)
    for role in ("gateway", "prefill", "decode", "kvstore", "mixed"):
        if f"pdmesh {role} " in text or f"-m pdmesh {role}" in text:
            return role
    for marker, name in (("services.decode.edge", "decode-edge"),
                         ("services.prefill.edge", "prefill-edge"),
                         ("mooncake_master", "mooncake_master"), ("redis-server", "redis"),
                         ("pdmesh up", "up"), ("pdmesh serve", "serve")):
        if marker in text:
            return name
    return Path(cmd[0]).name if cmd else "?"


async def one(client: httpx.AsyncClient, url: str, rng: random.Random, cancel: float,
              counts: dict[str, int]) -> None:
    prompt = [rng.randrange(50, 4000) for _ in range(rng.randrange(50, 1500))]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": rng.randrange(16, 256),
            "ignore_eos": True, "temperature": 0.8, "stream": rng.random() < 0.5}
    drop = body["stream"] and rng.random() < cancel * 2  # (of the streams: half the load)
    after = rng.uniform(0.2, 3.0)
    try:
        if not body["stream"]:
            r = await client.post(url + "/v1/completions", json=body)
            counts["ok" if r.status_code == 200 else f"http {r.status_code}"] += 1
            return
        t0 = time.monotonic()
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                if drop and time.monotonic() - t0 > after:
                    counts["cancelled"] += 1
                    return  # (the stream closed mid-way)
        counts["ok" if r.status_code == 200 else f"http {r.status_code}"] += 1
    except httpx.HTTPError as e:
        counts[type(e).__name__] += 1


async def load(url: str, a: argparse.Namespace, samples: list, pids: dict[int, str]
               ) -> dict[str, int]:
    rng = random.Random(a.seed)
    counts = _Counts(ok=0, cancelled=0)
    end = time.monotonic() + a.minutes * 60
    start = time.monotonic()
    tasks: set[asyncio.Task] = set()

    async def sampler() -> None:
        while time.monotonic() < end:
            samples.append((round(time.monotonic() - start, 1),
                            {pid: rss_kb(pid) for pid in pids}))
            await asyncio.sleep(a.every)

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        watch = asyncio.ensure_future(sampler())
        while time.monotonic() < end:
            task = asyncio.ensure_future(one(client, url, rng, a.cancel, counts))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(a.rate))
        await asyncio.gather(*tasks, return_exceptions=True)
        await watch
    samples.append((round(time.monotonic() - start, 1), {pid: rss_kb(pid) for pid in pids}))
    return dict(counts)


class _Counts(dict):
    def __missing__(self, key: str) -> int:
        return 0


def report(samples: list, pids: dict[int, str], a: argparse.Namespace) -> list[dict]:
    warm_at = a.minutes * 60 * a.warmup
    warm = next(s for t, s in samples if t >= warm_at)
    last_t, last = samples[-1]
    warm_t = next(t for t, _ in samples if t >= warm_at)
    hours = max(1e-9, (last_t - warm_t) / 3600)
    rows = []
    for pid, name in sorted(pids.items(), key=lambda kv: kv[1]):
        if not warm.get(pid) or not last.get(pid):
            continue
        growth = (last[pid] - warm[pid]) / warm[pid] * 100 / hours
        rows.append({"process": name, "pid": pid, "warm_mb": round(warm[pid] / 1024, 1),
                     "end_mb": round(last[pid] / 1024, 1),
                     "peak_mb": round(max(s.get(pid, 0) for _, s in samples) / 1024, 1),
                     "growth_pct_per_hour": round(growth, 1)})
    return rows


def largest_mappings(pid: int, top: int = 8) -> list[tuple[float, str]]:
    """The process's mappings by resident size, largest first: (MB, the mapping's line)."""
    rows, head = [], ""
    try:
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            if line[:1].isdigit() or line[:1] in "abcdef" and "-" in line.split()[0]:
                head = line
            elif line.startswith("Rss:"):
                rows.append((int(line.split()[1]) / 1024, head))
    except OSError:
        return []
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--command", default="up", choices=("up", "serve"))
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=1.5, help="requests per second")
    p.add_argument("--cancel", type=float, default=0.15,
                   help="share of all requests dropped mid-stream by their client")
    p.add_argument("--every", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--warmup", type=float, default=0.2,
                   help="share of the run before the 'warm' RSS is taken")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-args", default="", help="more flags for the engines")
    p.add_argument("--logs", default="/tmp/pdmesh-soak-logs")
    p.add_argument("--out", default=None, help="write samples and report as JSON here")
    a = p.parse_args()
    logs = Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    proc, url = start_pdmesh(a.command, a.model, logs,
                             engine_args=f" {a.engine_args}" if a.engine_args else "")
    try:
        pids = tree(proc.pid)
        samples: list = []
        t0 = time.monotonic()
        counts = asyncio.run(load(url, a, samples, pids))
        time.sleep(3)  # (aborts and puts settle)
        rows = report(samples, pids, a)
        print(f"soak: {a.minutes} min at {a.rate} req/s, {time.monotonic() - t0:.0f} s; "
              f"requests {counts}")
        print(f"{'process':16} {'pid':>7} {'warm MB':>9} {'end MB':>8} {'peak MB':>8} "
              f"{'growth %/h':>11}")
        for r in rows:
            print(f"{r['process']:16} {r['pid']:>7} {r['warm_mb']:>9} {r['end_mb']:>8} "
                  f"{r['peak_mb']:>8} {r['growth_pct_per_hour']:>11}")
        for pid, name in pids.items():  # where each engine's memory lies, mapping by mapping
            if name in ("prefill", "decode", "mixed"):
                print(f"{name}: the largest resident mappings (MB)")
                for mb, what in largest_mappings(pid):
                    print(f"  {mb:8.1f}  {what}")
        if a.out:
            Path(a.out).write_text(json.dumps({
                "args": vars(a), "requests": counts, "report": rows,
                "names": {str(k): v for k, v in pids.items()},
                "samples": [[t, {str(k): v for k, v in s.items()}] for t, s in samples]}))
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
