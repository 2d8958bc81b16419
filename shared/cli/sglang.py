"""`pdmesh sglang`: SGLang's `launch_server` command line, as the seeds write it.

    pdmesh sglang --model-path M [--tp-size 1 --mem-fraction-static 0.8 ...]
        -> one mixed instance behind the OpenAI gateway (`pdmesh serve`), on SGLang's
           port 30000 unless --port says otherwise
    pdmesh sglang --model-path M --disaggregation-mode prefill|decode \\
                  --disaggregation-transfer-backend mooncake ...
        -> a prefill or decode instance of the mesh (`pdmesh prefill` / `decode`; the
           kvstore is the registry's unless --kvstore names one); where
           SGLang's router (`sglang_router.launch_router --pd-disaggregation`) would
           stand, `pdmesh gateway` routes over the registry:
    pdmesh sglang-router --pd-disaggregation --prefill URL --decode URL --model-path M ...
        -> `pdmesh gateway M` on the router's port 30000 (translate_router)

The line is rewritten into that command's and read by the one flag table: the flags
pdmesh implements take effect under their SGLang names, the others are listed at
start-up as without effect, and a misspelt one gets a did-you-mean.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

MODES = {"null": "serve", "prefill": "prefill", "decode": "decode"}
BACKENDS = ("mooncake", "ascend")  # both run as pdmesh's Mooncake pool
SGLANG_PORT = "30000"
# SGLang's parser names -> vLLM's, which the gateway takes (others: named as refused)
PARSER_NAMES = {
    "--reasoning-parser": {"deepseek-r1": "deepseek_r1", "deepseek-v3": "deepseek_v3",
                           "qwen3-thinking": "qwen3"},
    "--tool-call-parser": {"qwen": "hermes", "qwen25": "hermes", "llama3": "llama3_json",
                           "deepseekv3": "deepseek_v3", "deepseekv31": "deepseek_v31"}}


def translate(words: list[str]) -> tuple[list[str], list[str]]:
    """(the pdmesh command line, warnings) for SGLang's ``words``. ValueError naming the
    flag for a value pdmesh cannot run."""
    rest: list[str] = []
    taken: dict[str, str] = {}
    i = 0
    while i < len(words):
        word = words[i]
        name, eq, value = word.partition("=")
        if name in PARSER_NAMES and (eq or i + 1 < len(words)):
            given = value if eq else words[i + 1]
            named = PARSER_NAMES[name].get(given, given)
            rest += [f"{name}={named}"] if eq else [name, named]
            i += 1 if eq else 2
            continue
        if name in ("--disaggregation-mode", "--disaggregation-transfer-backend",
                    "--disaggregation-bootstrap-port"):
            if not eq:
                if i + 1 >= len(words):
                    raise ValueError(f"{name}: needs a value")
                value = words[i + 1]
                i += 1
            taken[name] = value
        else:
            rest.append(word)
        i += 1
    mode = taken.get("--disaggregation-mode", "null")
    if mode not in MODES:
        raise ValueError(f"--disaggregation-mode: must be one of {', '.join(MODES)}, got "
                         f"{mode!r}")
    backend = taken.get("--disaggregation-transfer-backend", "mooncake")
    if backend not in BACKENDS:
        raise ValueError(f"--disaggregation-transfer-backend: pdmesh moves KV through its "
                         f"Mooncake pool ({' or '.join(BACKENDS)}), got {backend!r}")
    warnings = []
    if "--disaggregation-bootstrap-port" in taken:
        warnings.append("--disaggregation-bootstrap-port: without effect (instances find "
                        "each other through the registry and the kvstore)")
    if mode != "null" and "--disaggregation-transfer-backend" not in taken:
        warnings.append("--disaggregation-transfer-backend: not given; pdmesh's Mooncake "
                        "pool moves the KV")
    command = MODES[mode]
    if command == "serve" and not any(w == "--port" or w.startswith("--port=")
                                      for w in rest):
        rest += ["--port", SGLANG_PORT]
    return [command, *rest], warnings


# -- SGLang's router ---------------------------------------------------------------------
# `python -m sglang_router.launch_router` flags (sgl-router's RouterArgs): how many values
# each takes ("?" one or two, "*" any, "+" one or more) and what pdmesh's gateway does
# with it.
ROUTER_PORT = "30000"
_ROUTER_TAKEN = {  # flag -> the gateway's
    "--host": "--host", "--port": "--port", "--max-payload-size": "--max-request-body-bytes",
    "--max-concurrent-requests": "--max-queued-requests", "--log-level": "--log-level",
}
_ROUTER_MODEL = ("--model-path", "--tokenizer-path")
_ROUTER_WORKERS = {"--prefill": "?", "--decode": 1, "--worker-urls": "*"}
_ROUTER_IDLE = {  # accepted, without effect: pdmesh's gateway has its own way
    "--policy": 1, "--prefill-policy": 1, "--decode-policy": 1, "--mini-lb": 0,
    "--worker-startup-timeout-secs": 1, "--worker-startup-check-interval": 1,
    "--cache-threshold": 1, "--balance-abs-threshold": 1, "--balance-rel-threshold": 1,
    "--eviction-interval-secs": 1, "--max-tree-size": 1, "--dp-aware": 0,
    "--enable-igw": 0, "--api-key": 1, "--log-dir": 1, "--service-discovery": 0,
    "--selector": "+", "--service-discovery-port": 1, "--service-discovery-namespace": 1,
    "--prefill-selector": "+", "--decode-selector": "+", "--bootstrap-port-annotation": 1,
    "--prometheus-port": 1, "--prometheus-host": 1, "--request-id-headers": "*",
    "--request-timeout-secs": 1, "--queue-size": 1, "--queue-timeout-secs": 1,
    "--rate-limit-tokens-per-second": 1, "--cors-allowed-origins": "*",
    "--retry-max-retries": 1, "--retry-initial-backoff-ms": 1, "--retry-max-backoff-ms": 1,
    "--retry-backoff-multiplier": 1, "--retry-jitter-factor": 1, "--disable-retries": 0,
    "--cb-failure-threshold": 1, "--cb-success-threshold": 1,
    "--cb-timeout-duration-secs": 1, "--cb-window-duration-secs": 1,
    "--disable-circuit-breaker": 0, "--health-failure-threshold": 1,
    "--health-success-threshold": 1, "--health-check-timeout-secs": 1,
    "--health-check-interval-secs": 1, "--health-check-endpoint": 1,
}
_WHY_IDLE = {
    "--api-key": "it authorises the router with its workers; pdmesh's internal calls carry "
                 "the cluster secret, and the gateway's own key is --api-key after the "
                 "router's flags are read (or PDMESH_API_KEY)",
    "--prometheus-port": "the gateway serves /metrics on its own port",
    "--prometheus-host": "the gateway serves /metrics on its own port",
}


def _values(words: list[str], i: int, arity: int | str) -> tuple[list[str], int]:
    """The values of the flag at ``words[i]`` and the index after them."""
    name, eq, value = words[i].partition("=")
    if eq:
        return [value], i + 1
    j = i + 1
    while j < len(words) and not words[j].startswith("--"):
        j += 1
    got = words[i + 1:j]
    most = {0: 0, 1: 1, "?": 2}.get(arity, len(got))  # type: ignore[call-overload]
    least = {"*": 0, 0: 0}.get(arity, 1)  # type: ignore[call-overload]
    got = got[:most]
    if len(got) < least:
        raise ValueError(f"{name}: needs a value")
    return got, i + 1 + len(got)


def translate_router(words: list[str]) -> tuple[list[str], list[str]]:
    """(the `pdmesh gateway` command line, warnings) for SGLang router flags (``python -m
    sglang_router.launch_router --pd-disaggregation --prefill URL --decode URL ...``).
    The gateway finds prefill and decode instances in the registry, so the worker URLs are
    not dialled; it needs the model (its tokenizer): --model-path or --tokenizer-path.
    Flags that are not the router's pass through to the gateway (--redis-url, ...), whose
    parser names any unknown one."""
    out: list[str] = []
    model = None
    warnings: list[str] = []
    workers: list[str] = []
    i = 0
    while i < len(words):
        name = words[i].partition("=")[0]
        if name == "--pd-disaggregation":  # pdmesh always is
            i += 1
        elif name in _ROUTER_MODEL:
            (value,), i = _values(words, i, 1)
            model = value if name == "--model-path" or model is None else model
        elif name in _ROUTER_TAKEN:
            (value,), i = _values(words, i, 1)
            if name == "--log-level":
                value = value.upper()
            out += [_ROUTER_TAKEN[name], value]
        elif name in _ROUTER_WORKERS:
            got, i = _values(words, i, _ROUTER_WORKERS[name])
            workers += [f"{name} {' '.join(got)}".strip()]
        elif name in _ROUTER_IDLE:
            _, i = _values(words, i, _ROUTER_IDLE[name])
            why = _WHY_IDLE.get(name, "pdmesh's gateway routes by its own policy")
            warnings.append(f"{name}: without effect ({why})")
        else:
            out.append(words[i])
            i += 1
    if model is None:
        raise ValueError("--model-path: pdmesh's gateway tokenizes, so it needs the model "
                         "(or --tokenizer-path)")
    if workers:
        warnings.append(f"{', '.join(workers)}: not dialled - the gateway finds prefill and "
                        "decode instances in the registry (--redis-url)")
    if "--port" not in out:
        out += ["--port", ROUTER_PORT]
    return ["gateway", model, *out], warnings
