"""`pdmesh proxy`: vLLM-Ascend's PD proxy line (examples/disaggregated_prefill_v1/
load_balance_proxy_server_example.py, which the seeds' PD recipe runs to join P and D
nodes) as the gateway, dialling the instances it names:

    pdmesh proxy --host 0.0.0.0 --port 8000 --prefiller-hosts P1 P2 --prefiller-ports 8001 8001 \\
        --decoder-hosts D1 --decoder-ports 8002

-> `pdmesh gateway MODEL --prefill-addresses P1:8001 P2:8001 --decode-addresses D1:8002
--served-model-name NAME ...`. The P and D nodes are the recipe's `vllm serve` lines under
`pdmesh serve` (kv_producer / kv_consumer: prefill and decode instances, whose --port is
their gRPC port). The proxy line names no model; the gateway tokenizes, so it takes the
folder and served name the instances report, or --model / --served-model-name when
given. Flags that are not the proxy's pass through to the gateway.
"""

from __future__ import annotations

# vLLM-Ascend's parse_args: flag -> (how many values, default)
_PROXY = {"--host": (1, ["localhost"]), "--port": (1, ["8000"]),
          "--prefiller-hosts": ("+", ["localhost"]), "--prefiller-ports": ("+", ["8001"]),
          "--decoder-hosts": ("+", ["localhost"]), "--decoder-ports": ("+", ["8002"]),
          "--max-retries": (1, ["3"]), "--retry-delay": (1, ["0.001"]),
          "--max-waiting-retries": (1, ["3"]), "--waiting-retry-interval": (1, ["10"]),
          "--workers": (1, ["1"]), "--log-level": (1, ["INFO"])}
_WHY_IDLE = {
    "--max-retries": "the gateway retries a failed prefill or decode call on another "
                     "instance by its own policy (3 each)",
    "--retry-delay": "the gateway's own backoff",
    "--workers": "one gateway process serves every connection (asyncio)",
}


def _values(words: list[str], i: int) -> tuple[str, list[str], int]:
    name, eq, value = words[i].partition("=")
    if eq:
        return name, [value], i + 1
    j = i + 1
    while j < len(words) and not words[j].startswith("--"):
        j += 1
    got = words[i + 1:j]
    arity = _PROXY[name][0]
    if not got:
        raise ValueError(f"{name}: needs a value")
    if arity == 1:
        got = got[:1]
    return name, got, i + 1 + len(got)


def _pairs(hosts: list[str], ports: list[str], what: str) -> list[str]:
    if len(hosts) != len(ports):
        raise ValueError(f"--{what}-hosts / --{what}-ports: {len(hosts)} host(s) but "
                         f"{len(ports)} port(s); each host needs its port")
    for port in ports:
        if not port.isdigit():
            raise ValueError(f"--{what}-ports: {port!r} is not a port number")
    return [f"{h}:{p}" for h, p in zip(hosts, ports, strict=True)]


def translate_proxy(words: list[str], *, find_model=None) -> tuple[list[str], list[str]]:
    """(the `pdmesh gateway` command line, warnings) for the proxy's flags. ``find_model``
    (prefill, decode, wait_s) -> (folder, served name): how the model is found when the
    line gives none (default: asked of the named instances)."""
    given = {name: list(default) for name, (_, default) in _PROXY.items()}
    rest: list[str] = []
    warnings: list[str] = []
    i = 0
    while i < len(words):
        if words[i].partition("=")[0] in _PROXY:
            name, got, i = _values(words, i)
            given[name] = got
            if name in _WHY_IDLE:
                warnings.append(f"{name}: without effect ({_WHY_IDLE[name]})")
        else:
            rest.append(words[i])
            i += 1
    prefill = _pairs(given["--prefiller-hosts"], given["--prefiller-ports"], "prefiller")
    decode = _pairs(given["--decoder-hosts"], given["--decoder-ports"], "decoder")
    try:
        wait_s = (int(given["--max-waiting-retries"][0])
                  * float(given["--waiting-retry-interval"][0]))
    except ValueError:
        raise ValueError("--max-waiting-retries / --waiting-retry-interval: must be "
                         "numbers") from None
    if wait_s < 0:
        raise ValueError("--max-waiting-retries / --waiting-retry-interval: must be >= 0")
    out = ["gateway"]
    named = {w.partition("=")[0] for w in rest}
    if "--model" not in named:
        if find_model is None:
            from pdmesh.services.gateway.named import NamedInstances

            def find_model(p, d, wait):
                return NamedInstances(p, d).model(wait)
        folder, served = find_model(prefill, decode, wait_s)
        out += ["--model", folder]
        if "--served-model-name" not in named and served:
            out += ["--served-model-name", served]
    # the proxy's wait for its nodes: how long a request waits for an instance to be up
    out += ["--host", given["--host"][0], "--port", given["--port"][0],
            "--log-level", given["--log-level"][0].upper(),
            "--prefill-addresses", *prefill, "--decode-addresses", *decode]
    if "--instance-grace" not in named:
        out += ["--instance-grace", f"{wait_s:g}"]
    return [*out, *rest], warnings
