"""`pdmesh up`: the whole mesh on one box, as separate local processes.

    redis (the one listening, else a redis-server of ours) -> kvstore (+ mooncake_master)
    -> N prefill, M decode instances -> gateway; prints the URL once it answers.
    Ctrl-C (or SIGTERM) stops every process it started, by process group.

Without ``--model`` it makes the tiny demo model first (``pdmesh make-tiny-model``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from pdmesh.shared.infra.launcher import Service
from pdmesh.shared.infra.signals import SignalStop
from pdmesh.shared.models.config import ModelConfig

DEMO_MODEL = Path(".cache/models/tiny-qwen3")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder (default: the tiny demo model)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--prefill", type=int, default=1, help="prefill instances")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument("--port", type=int, default=8000, help="the gateway's HTTP port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--redis-url", default=None,
                   help="default: redis on 127.0.0.1:6379, started if none listens")
    p.add_argument("--registry-prefix", default="pdmesh")
    p.add_argument("--api-key", default=None)
    p.add_argument("--log-dir", default=None, help="default: a fresh temporary folder")
    p.add_argument("--engine-args", default="",
                   help="extra engine flags for prefill and decode, as one string")
    p.add_argument("--prefill-args", default="", help="extra flags for prefill only")
    p.add_argument("--prefill-offload-threshold", type=int, default=2048, metavar="TOKENS",
                   help="the gateway's: while prefill has this many prompt tokens queued, "
                        "decode instances prefill new prompts themselves (on one box they "
                        "share the cores anyway); 0: never")
    p.add_argument("--otlp-traces-endpoint", default=None,
                   help="trace every service to this OTLP/gRPC collector")
    p.add_argument("--decode-args", default="",
                   help="extra flags for decode only, e.g. \"--data-parallel-size 2 "
                        "--enable-expert-parallel\"")


def _ranks(args: list[str]) -> int:
    """Engine processes one instance with these flags runs (its data-parallel size)."""
    for flag in ("--data-parallel-size", "-dp"):
        if flag in args[:-1]:
            return max(1, int(args[args.index(flag) + 1]))
    return 1


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _start_redis(log_dir: Path) -> tuple[subprocess.Popen[bytes] | None, str]:
    if _listening("127.0.0.1", 6379):
        return None, "redis://127.0.0.1:6379/0"
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis: nothing listens on 127.0.0.1:6379 and redis-server "
                                "is not installed (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(log_dir)],
                            stdout=open(log_dir / "redis.log", "wb"),  # noqa: SIM115
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 10
    while not _listening("127.0.0.1", port):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"redis-server did not start; see {log_dir / 'redis.log'}")
        time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def run(a: argparse.Namespace, mixed: bool = False) -> int:
    """``mixed``: `pdmesh serve` — one mixed instance (no pool) instead of the PD pair."""
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="pdmesh-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model = Path(a.model) if a.model else DEMO_MODEL
    if a.model is None and not (model / "config.json").is_file():
        from pdmesh.shared.models.tiny import make_tiny_model

        print(f"[up] making the tiny demo model in {model}", flush=True)
        make_tiny_model(model, "qwen3", seed=0)
    name = a.served_model_name or model.name
    stop = SignalStop().install()
    started: list[Service] = []
    redis_proc = None
    try:
        if a.redis_url:
            redis_url = a.redis_url
        else:
            redis_proc, redis_url = _start_redis(log_dir)
        reg = ["--redis-url", redis_url, "--registry-prefix", a.registry_prefix]
        print(f"[up] redis at {redis_url}; logs in {log_dir}", flush=True)
        trace = (["--otlp-traces-endpoint", a.otlp_traces_endpoint]
                 if a.otlp_traces_endpoint else [])
        workers = ["--model", str(model), "--served-model-name", name, "--host", a.host,
                   *a.engine_args.split(), *reg, *trace]
        roles = [("mixed", 1)]
        if not mixed:
            kv = Service("kvstore", ["kvstore", "--host", a.host, *reg], log_dir)
            started.append(kv)
            print(f"[up] kvstore ready at {kv.address} (mooncake master {kv.info['master']})",
                  flush=True)
            workers += ["--kvstore", kv.address]
            roles = [("prefill", a.prefill), ("decode", a.decode)]
            if ModelConfig.from_folder(model).moe is not None:  # experts to balance
                ctl = Service("eplb", ["eplb", "--host", a.host, *reg], log_dir)
                started.append(ctl)
                print(f"[up] eplb controller ready at {ctl.address}", flush=True)
        # Share the cores among the engines: torch threads that outnumber the cores spin
        # against each other (on 2 cores, 1 thread each nearly doubled rate-inf throughput).
        extra = {"prefill": a.prefill_args.split(), "decode": a.decode_args.split(),
                 "mixed": a.decode_args.split()}
        engines = sum(count * _ranks(extra[role]) for role, count in roles)
        threads = os.environ.get("OMP_NUM_THREADS") or str(
            max(1, (os.cpu_count() or 1) // engines))
        print(f"[up] {engines} engine(s), {threads} torch thread(s) each", flush=True)
        for role, count in roles:
            for i in range(count):
                svc = Service(role, [role, *workers, *extra[role]], log_dir,
                              env={"OMP_NUM_THREADS": threads})
                started.append(svc)
                print(f"[up] {role} {i + 1}/{count} ready at {svc.address}", flush=True)
        gw_args = ["gateway", "--model", str(model), "--served-model-name", name,
                   "--host", a.host, "--port", str(a.port), *reg, *trace,
                   "--prefill-offload-threshold", str(a.prefill_offload_threshold)]
        if a.api_key:
            gw_args += ["--api-key", a.api_key]
        gw = Service("gateway", gw_args, log_dir)
        started.append(gw)
        url = gw.info["http"]
        _wait_healthy(url)
        print(f"[up] mesh ready: {url}/v1  (model {name!r})\n"
              f"     try: curl {url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{name}\", \"prompt\": \"def fib(n):\", "
              f"\"max_tokens\": 32}}'\n     Ctrl-C stops everything.", flush=True)
        exited = False
        while not exited and not stop.wait(0.5):
            for svc in started:
                if svc.proc.poll() is not None:
                    print(f"[up] {svc.role} exited with {svc.proc.returncode}; see "
                          f"{svc.log_path}", file=sys.stderr, flush=True)
                    exited = True
    finally:
        print("[up] stopping", flush=True)
        for svc in reversed(started):
            svc.stop()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
    return 0


def _wait_healthy(url: str, timeout_s: float = 30.0) -> None:
    """Until the gateway sees instances that can serve."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"gateway at {url} did not become healthy in {timeout_s}s")
