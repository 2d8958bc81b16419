"""The PD mesh the end-to-end tests start: kvstore (with its Mooncake master), one
prefill, one decode and a gateway, as real processes on loopback with free ports and
the test's own registry prefix, stopped by process id whatever happens."""

from __future__ import annotations

import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pdmesh.shared.infra.launcher import Service, stop_together

MODEL = "tiny"  # the served model name
ENGINE = ["--device", "cpu", "--dtype", "float32", "--block-size", "16",
          "--pool-segment-mb", "64"]


@contextmanager
def pd_mesh(model: Path, logs: Path, prefix: str, *, gateway_args: Sequence[str] = (),
            prefill_args: Sequence[str] = (), decode_args: Sequence[str] = (),
            decodes: int = 1, everywhere: Sequence[str] = ()
            ) -> Iterator[dict[str, Any]]:
    """{"kvstore", "prefill", "decode", "decodes", "gateway"}: the running services
    ("decode" the first of ``decodes``; the gateway's URL is ``["gateway"].info["http"]``).
    ``everywhere``: flags every service gets (another --redis-url)."""
    reg = ["--registry-prefix", prefix, *everywhere]
    started: list[Service] = []
    try:
        kv = Service("kvstore", ["kvstore", *reg], logs)
        started.append(kv)
        engines = [Service(role, [role, str(model), "--kvstore", kv.address,
                                  "--served-model-name", MODEL, *ENGINE, *extra, *reg],
                           logs, wait=False)
                   for role, extra in (("prefill", prefill_args),
                                       *[("decode", decode_args)] * decodes)]
        started += engines
        for s in engines:  # (loading side by side)
            s.wait_ready()
        started.append(Service("gateway", ["gateway", str(model), "--port", "0",
                                           "--served-model-name", MODEL, *gateway_args,
                                           *reg], logs))
        roles: dict[str, Any] = {}
        for s in started:
            roles.setdefault(s.role, s)
        yield {**roles, "decodes": [s for s in started if s.role == "decode"]}
    finally:
        stop_all(started)


def stop_all(started: Sequence[Service]) -> None:
    """Stop a test's services whatever state they are in: the gateway and the engines
    together (their drains overlap), then the kvstore they put to."""
    for s in started:
        if s.proc.poll() is None:
            s.signal(signal.SIGCONT)  # a test may have stopped it
    stop_together([s for s in started if s.role != "kvstore"])
    stop_together([s for s in started if s.role == "kvstore"])
