"""`pdmesh up` / `pdmesh serve`: the whole mesh on one box, as separate local processes.

    redis (the one listening, else a redis-server of ours) -> kvstore (+ mooncake_master)
    -> N prefill, M decode instances -> gateway; prints the URL once it answers.
    Ctrl-C (or SIGTERM) stops every process it started, by process group.

`pdmesh serve MODEL [vllm serve flags]` starts one mixed instance (no pool) behind the
gateway instead: a `vllm serve` command line, with `vllm` replaced by `pdmesh`, runs
as it is (--host, --port, --api-key go to the gateway; the engine flags to the
instance). Each engine's command line is checked the way the engine checks it before
anything starts. Without a model it makes the tiny demo model first.

A `vllm serve` line of a PD deployment (--kv-transfer-config with kv_role "kv_producer"
or "kv_consumer", as the seeds' P and D nodes run it) becomes that instance of the mesh
instead: this process turns into `pdmesh prefill` / `pdmesh decode` with the line's
flags (--host and --port its gRPC listener), which finds the kvstore in the registry;
`pdmesh gateway` stands where vLLM's PD proxy would. The gateway's own flags are listed
as without effect there.
"""

from __future__ import annotations

import atexit
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from pdmesh.shared.config.command_line import to_words
from pdmesh.shared.config.flags import FLAGS
from pdmesh.shared.config.serve import KV_ROLE_OF, ServeConfig, api_key, serve_config
from pdmesh.shared.infra.bindhost import bound_env
from pdmesh.shared.infra.cluster_auth import SECRET_FILE_ENV, per_run_secret
from pdmesh.shared.infra.launcher import Service, die_with_parent, stop_together
from pdmesh.shared.infra.signals import SignalStop
from pdmesh.shared.models.config import ModelConfig
from pdmesh.shared.runtime.shared_cores import BELOW_ENV, PATH_ENV, create, requested_yield

DEMO_MODEL = Path(".cache/models/tiny-qwen3")
# what the gateway makes of the model's chats and output (vLLM's flags of these names)
SERVING_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser",
                 "--tokenizer-mode", "--tokenizer", "--chat-template",
                 "--trust-request-chat-template", "--structured-outputs-config",
                 "--enable-log-requests", "--log-requests-level", "--generation-config",
                 "--override-generation-config", "--preferred-sampling-params",
                 "--enable-force-include-usage", "--enable-prompt-tokens-details",
                 "--stream-interval", "--enable-return-hidden-states")


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _start_redis(log_dir: Path, port: int | None = None
                 ) -> tuple[subprocess.Popen[bytes] | None, str]:
    """A redis for the mesh: the one on 127.0.0.1:6379 if it listens (None: not ours),
    else our own on ``port`` (default: a free one)."""
    if port is None and _listening("127.0.0.1", 6379):
        return None, "redis://127.0.0.1:6379/0"
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis: nothing listens on 127.0.0.1:6379 and redis-server "
                                "is not installed (apt-get install redis-server)")
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(log_dir)],
                            stdout=open(log_dir / "redis.log", "ab"),  # noqa: SIM115
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=die_with_parent)  # gone with `up`, even on SIGKILL
    deadline = time.monotonic() + 10
    while not _listening("127.0.0.1", port):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"redis-server did not start; see {log_dir / 'redis.log'}")
        time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


# flags of `pdmesh serve`'s command line that are not handed on to its engine instance
# as they are: they are the launcher's, the gateway's, or passed on by the launcher itself
NOT_FOR_THE_ENGINE = {"--model", "--port", "--api-key", "--api-key-file",
                      "--max-request-body-bytes", "--request-body-timeout", "--stall-timeout",
                      "--instance-grace",
                      "--served-model-name", "--host",
                      "--redis-url", "--registry-prefix", "--log-dir", "--engine-args",
                      "--prefill-args", "--decode-args", "--prefill-offload-threshold",
                      "--enable-trace", "--otlp-traces-endpoint", "--log-level",
                      "--log-format", "--max-queued-requests", *SERVING_FLAGS}


@dataclass
class Plan:
    """What `up` / `serve` starts, its engines' flags already checked."""

    model: Path
    names: tuple[str, ...]  # the served model names (the first is the one reported)
    roles: list[tuple[str, int]]  # engine role, instances
    engine_words: dict[str, list[str]]  # role -> its flags (beyond the common ones)
    ranks: dict[str, int]  # role -> processes per instance (its data-parallel size)
    log_dir: Path
    slots: int = 0  # requests the engines that decode run at once, all of them together

    def queue_bound(self, asked: int | None) -> int:
        """The requests the gateway takes in flight before it answers 429: as asked, or
        twice the decoding engines' batch slots (a batch running, one waiting: past
        that a request would wait longer than a batch takes to finish)."""
        return asked if asked is not None else max(1, 2 * self.slots)


def plan(cfg: ServeConfig) -> Plan:
    """ValueError naming the flag when an engine would refuse its flags: each engine's
    exact command line goes through serve_config first, as the engine itself will."""
    log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="pdmesh-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model = Path(cfg.model) if cfg.model else DEMO_MODEL
    if cfg.model is None and not (model / "config.json").is_file():
        from pdmesh.shared.models.tiny import make_tiny_model

        print(f"[up] making the tiny demo model in {model}", flush=True)
        make_tiny_model(model, "qwen3", seed=0)
    direct = to_words(cfg.flags, [f.name for f in FLAGS if "mixed" in f.commands
                                  and f.name not in NOT_FOR_THE_ENGINE])
    common = [*direct, *_words("--engine-args", cfg.engine_flags)]
    mixed = cfg.command == "serve"
    roles = [("mixed", 1)] if mixed else [("prefill", cfg.prefill), ("decode", cfg.decode)]
    decode = _words("--decode-args", cfg.decode_flags)
    words = {"prefill": [*common, *_words("--prefill-args", cfg.prefill_flags)],
             "decode": ["--decode-tpot-slo-ms", str(cfg.decode_tpot_slo_ms), *common, *decode],
             "mixed": [*common, *decode]}
    ranks, slots = {}, 0
    for role, count in roles:  # (each engine finds its device itself)
        checked = serve_config(role, [str(model), *words[role]], device="cpu")
        ranks[role] = checked.data_parallel_size
        if role != "prefill":
            slots += count * ranks[role] * checked.engine.max_num_seqs
    # served as given on the command line, as `vllm serve MODEL` is (the demo model by
    # its folder's name)
    names = cfg.served_model_name or ((cfg.model,) if cfg.model else (model.name,))
    return Plan(model, names, roles, words, ranks, log_dir, slots)


def _words(flag: str, text: str) -> list[str]:
    """A launcher's flags-in-one-string, split as a shell would (a JSON value in quotes
    stays one word)."""
    try:
        return shlex.split(text)
    except ValueError as e:
        raise ValueError(f"{flag}: {e} in {text!r}") from None


def run(cfg: ServeConfig) -> int:
    """`pdmesh up`: the PD mesh; `pdmesh serve`: one mixed instance (no pool), or the
    prefill / decode instance its kv_role names."""
    if cfg.command == "serve" and (cfg.kv_role in KV_ROLE_OF or cfg.flags.headless):
        return _become_pd_instance(cfg)
    p = plan(cfg)
    stop = SignalStop().install()
    started: list[Service] = []
    redis = None
    secret = per_run_secret()  # internals and the registry closed to other processes
    if secret is not None:
        os.environ[SECRET_FILE_ENV] = str(secret)  # (every service inherits it)
        atexit.register(shutil.rmtree, secret.parent, True)
    try:
        if secret is not None:
            print(f"[up] a cluster secret for this run: {SECRET_FILE_ENV}={secret} (for "
                  "`pdmesh status` and other callers of the services' internals)",
                  flush=True)
        if cfg.redis_url:
            redis_url = cfg.redis_url
        else:
            redis = MeshRedis(p.log_dir)
            redis_url = redis.url
        print(f"[up] redis at {redis_url}; logs in {p.log_dir}", flush=True)
        reg = ["--redis-url", redis_url, "--registry-prefix", cfg.registry_prefix]
        trace = to_words(cfg.flags, ["--enable-trace", "--otlp-traces-endpoint"])
        workers = [str(p.model), "--served-model-name", *p.names, "--host", cfg.host, *reg,
                   *trace]
        if p.roles[0][0] != "mixed":
            workers += ["--kvstore", _start_pool(cfg, reg, p, started)]
        _start_engines(p, workers, cfg.host, started, cfg.prefill_offload_threshold)
        key = api_key(cfg.flags)  # to the gateway by its environment: `ps` shows no key
        key_env = {"PDMESH_API_KEY": key} if key else None
        gw = Service("gateway", ["gateway", str(p.model), "--served-model-name", *p.names,
                                 "--host", cfg.host, *reg, *trace,
                                 *to_words(cfg.flags, ["--port", "--max-model-len",
                                                       "--hf-overrides",
                                                       "--max-request-body-bytes",
                                                       "--request-body-timeout",
                                                       "--stall-timeout",
                                                       "--instance-grace",
                                                       "--metrics-names",
                                                       "--enable-lora", "--lora-modules",
                                                       "--lora-paths", *SERVING_FLAGS]),
                                 "--prefill-offload-threshold",
                                 str(cfg.prefill_offload_threshold), "--max-queued-requests",
                                 str(p.queue_bound(cfg.flags.max_queued_requests)),
                                 "--decode-tpot-slo-ms", str(cfg.decode_tpot_slo_ms)],
                     p.log_dir, env=key_env)
        started.append(gw)
        _wait_healthy(gw.info["http"])
        _say_ready(gw.info["http"], p.names[0])
        _watch(started, stop, redis.check if redis is not None else lambda: None)
    finally:
        print("[up] stopping", flush=True)
        pool = [s for s in started if s.role == "kvstore"]
        # the gateway and the engines drain together, then the pool they put to goes
        stop_together([s for s in started if s.role != "kvstore"])
        stop_together(pool)
        if redis is not None:
            redis.stop()
        if secret is not None:
            shutil.rmtree(secret.parent, ignore_errors=True)
    return 0


def pd_instance_line(cfg: ServeConfig) -> tuple[list[str], list[str]]:
    """(the `pdmesh prefill` / `decode` line a PD `serve` line stands for - with
    --headless and no kv_role, the `pdmesh mixed` line of a node's engine ranks - the
    flags it gives that only the gateway takes)."""
    role = KV_ROLE_OF.get(cfg.kv_role, "mixed")
    taken = [f.name for f in FLAGS if role in f.commands]
    words = [role, *to_words(cfg.flags, taken)]
    if cfg.model and "--model" not in words:
        words.insert(1, str(cfg.model))
    idle = sorted(n for n in cfg.flags.shown if n not in taken)
    return words, idle


def _become_pd_instance(cfg: ServeConfig) -> int:
    words, idle = pd_instance_line(cfg)
    if words[0] == "mixed":
        print("[serve] --headless: this node's engine ranks alone, no gateway (they join "
              "rank 0's group at --data-parallel-address and register at --redis-url, "
              "where rank 0's node serves the API)", flush=True)
    else:
        print(f"[serve] kv_role {cfg.kv_role!r}: a {words[0]} instance of the mesh (vLLM's "
              f"{'P' if words[0] == 'prefill' else 'D'} node; `pdmesh gateway` is the PD "
              "proxy)", flush=True)
    for name in idle:
        print(f"[serve] {name}: without effect on a {words[0]} instance (a gateway flag: "
              f"give it to `pdmesh gateway`)", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "pdmesh", *words])
    return 0  # (not reached)


class MeshRedis:
    """The redis `up` uses: the one on 127.0.0.1:6379 if it listens (then not ours:
    ``proc`` is None), else a redis-server of ours (on ``port``, default a free one),
    started again on its port by ``check`` when it died."""

    def __init__(self, log_dir: Path, port: int | None = None):
        self.log_dir = log_dir
        self.proc, self.url = _start_redis(log_dir, port)
        self.port = urlparse(self.url).port
        self.restarts = 0

    def check(self) -> None:
        if self.proc is None or self.proc.poll() is None:
            return
        print(f"[up] redis exited with {self.proc.returncode}; restarting",
              file=sys.stderr, flush=True)
        try:
            self.proc, _ = _start_redis(self.log_dir, self.port)
            self.restarts += 1
        except RuntimeError as e:  # tried again at the next check
            print(f"[up] redis did not come back: {e}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


def _start_pool(cfg: ServeConfig, reg: list[str], p: Plan, started: list[Service]) -> str:
    """The kvstore (and, for a MoE model, the EPLB controller); the kvstore's address."""
    kv = Service("kvstore", ["kvstore", "--host", cfg.host, *reg], p.log_dir,
                 env=bound_env(cfg.host))
    started.append(kv)
    print(f"[up] kvstore ready at {kv.address} (mooncake master {kv.info['master']})",
          flush=True)
    if ModelConfig.from_folder(p.model).moe is not None:  # experts to balance
        ctl = Service("eplb", ["eplb", "--host", cfg.host, *reg], p.log_dir)
        started.append(ctl)
        print(f"[up] eplb controller ready at {ctl.address}", flush=True)
    return kv.address


def _start_engines(p: Plan, workers: list[str], host: str, started: list[Service],
                   backed_up: int = 0) -> None:
    """(Started with the bind shim's environment already: no re-exec at their start.)
    ``backed_up``: the prefill backlog past which decode steps on (the offload's)."""
    turns = _shared_cores(p.roles, p.log_dir, backed_up)
    threads = engine_threads(p.roles, p.ranks, os.cpu_count() or 1, os.environ, bool(turns))
    engines: list[tuple[str, int, int, Service]] = []
    for role, count in p.roles:
        env = {**bound_env(host), **threads[role], **turns}
        print(f"[up] {role}: {count * p.ranks[role]} engine(s), "
              f"{env['OMP_NUM_THREADS']} torch thread(s) each", flush=True)
        for i in range(count):
            svc = Service(role, [role, *workers, *p.engine_words[role]], p.log_dir, env=env,
                          wait=False)
            started.append(svc)
            engines.append((role, i, count, svc))
    for role, i, count, svc in engines:  # (all loading side by side)
        svc.wait_ready()
        print(f"[up] {role} {i + 1}/{count} ready at {svc.address}", flush=True)


def _shared_cores(roles: list[tuple[str, int]], log_dir: str | None, backed_up: int = 0
                  ) -> dict[str, str]:
    """Asked for with PDMESH_DECODE_YIELD=F > 0, prefill engines beside decode engines:
    the file they take turns through (shared_cores: decode waits F x its step while
    prefill has prompts to compute, fewer than ``backed_up`` tokens unless
    PDMESH_DECODE_YIELD_BELOW says otherwise), in /dev/shm where there is one; {}
    otherwise."""
    kinds = {role for role, count in roles if count}
    if not {"prefill", "decode"} <= kinds or not requested_yield(os.environ):
        return {}
    where = "/dev/shm" if os.path.isdir("/dev/shm") else (log_dir or None)
    fd, path = tempfile.mkstemp(prefix="pdmesh-cores-", dir=where)
    os.close(fd)
    create(path)
    atexit.register(lambda: os.path.exists(path) and os.unlink(path))
    return {PATH_ENV: path, BELOW_ENV: os.environ.get(BELOW_ENV) or str(backed_up)}


# a prefill engine's OpenMP threads while decode engines yield to it: busy-wait spins
# before they sleep (libgomp's GOMP_SPINCOUNT, ~1 ms here, as torch's CPU wheels link
# it; KMP_BLOCKTIME=1 ms for a build with Intel's OpenMP; issue 40, session 26)
PREFILL_SPIN_COUNT = 30_000


def engine_threads(roles: list[tuple[str, int]], ranks: dict[str, int], cores: int,
                   environ: Mapping[str, str], decode_yields: bool = False
                   ) -> dict[str, dict[str, str]]:
    """The OpenMP environment of each role's engines when they share this box's cores.

    Decode engines step all the time: each gets an equal share of the cores. A prefill
    engine works in bursts, a prompt at a time, so it gets the cores shared among the
    prefill engines only, and every engine's idle threads sleep at once instead of
    spinning (``OMP_WAIT_POLICY=PASSIVE``), so a prefill burst and a decode step can
    overlap without one spinning on the core the other needs. Measured on 2 cores (one
    prefill, one decode; docs/benchmarks.md, issue 13, session 7): TTFT p50 -17 to -29%
    across five traffic shapes, TPOT and throughput no worse, against 1 thread each
    with the default wait policy (which, with 2 prefill threads, made TTFT 3-18x
    worse). Engines of one role alone (a mixed instance, its DP ranks) share the cores
    equally with the library's default policy. The user's OMP_NUM_THREADS /
    OMP_WAIT_POLICY / GOMP_SPINCOUNT / KMP_BLOCKTIME win.

    ``decode_yields`` (PDMESH_DECODE_YIELD, shared_cores): decode steps aside while
    prefill computes, so a prefill engine's threads spin ``PREFILL_SPIN_COUNT`` times
    before they sleep instead, awake from one op of a step to the next (a thread woken
    for every op made a 900-token step ~25% longer on 2 cores); backed up, with decode
    stepping beside it, the prefill engine steps on one thread (``prefill_threads``).
    """
    engines = {role: count * ranks[role] for role, count in roles}
    total = sum(engines.values())
    split = "prefill" in engines and total > engines["prefill"]  # prefill beside decode
    out = {}
    for role, n in engines.items():
        if not split:  # every engine alike (one, or DP ranks of one role): equal shares
            env = {"OMP_NUM_THREADS": str(max(1, cores // total))}
        else:
            share = max(1, cores // (n if role == "prefill" else total))
            env = {"OMP_NUM_THREADS": str(share), "OMP_WAIT_POLICY": "PASSIVE"}
            if role == "prefill" and decode_yields and not environ.get("OMP_WAIT_POLICY"):
                env = {"OMP_NUM_THREADS": str(share),
                       "GOMP_SPINCOUNT": str(PREFILL_SPIN_COUNT),
                       "KMP_BLOCKTIME": "1"}  # (Intel OpenMP's: 1 ms, not its 200)
        for key in env:
            if environ.get(key):
                env[key] = environ[key]
        out[role] = env
    return out


def _say_ready(url: str, name: str) -> None:
    print(f"[up] mesh ready: {url}/v1  (model {name!r})\n"
          f"     try: curl {url}/v1/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{name}\", \"prompt\": \"def fib(n):\", "
          f"\"max_tokens\": 32}}'\n     Ctrl-C stops everything.", flush=True)


RESTART_MAX_DELAY_S = 30.0
STABLE_S = 60.0  # a service up this long before it died restarts at once again


def _watch(started: list[Service], stop: SignalStop,
           also: Callable[[], None] | None = None) -> None:
    """Until a signal: a service that exits is started again, on its old ports (its
    address is what the others know), after 0 s the first time and then 1, 2, 4 ... up to
    30 s while it keeps dying young. The mesh serves on meanwhile with what is left."""
    failures: dict[int, int] = {}
    due: dict[int, float] = {}
    while not stop.wait(0.5):
        if also is not None:
            also()
        for svc in started:
            key = id(svc)
            if svc.proc.poll() is None:
                continue
            now = time.monotonic()
            if key not in due:
                young = now - svc.started_at < STABLE_S
                failures[key] = failures.get(key, 0) + 1 if young else 1
                delay = 0.0 if failures[key] == 1 else min(RESTART_MAX_DELAY_S,
                                                           2.0 ** (failures[key] - 2))
                due[key] = now + delay
                print(f"[up] {svc.role} exited with {svc.proc.returncode} (see "
                      f"{svc.log_path}); restarting in {delay:g} s", file=sys.stderr,
                      flush=True)
            if now < due[key] or stop.is_set():
                continue
            del due[key]
            try:
                svc.respawn(sticky_ports(svc))
            except (RuntimeError, OSError) as e:
                print(f"[up] {svc.role} did not come back: {str(e).splitlines()[0]}",
                      file=sys.stderr, flush=True)
                continue
            print(f"[up] {svc.role} restarted at {svc.info.get('grpc') or svc.info.get('http')}",
                  flush=True)


def sticky_ports(svc: Service) -> dict[str, str]:
    """The flags that put a restarted service on the ports it had."""
    info = svc.info
    address = info.get("grpc") or info.get("http", "")
    out = {"--port": address.rsplit(":", 1)[1]} if ":" in address else {}
    if svc.role == "kvstore":
        if ":" in info.get("master", ""):
            out["--master-port"] = info["master"].rsplit(":", 1)[1]
        metadata = info.get("metadata", "")  # http://host:port/metadata
        if metadata.count(":") >= 2:
            out["--metadata-port"] = metadata.rsplit(":", 1)[1].split("/", 1)[0]
    return out


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
