"""`pdmesh gateway`: the OpenAI-compatible HTTP front of the mesh (FastAPI + uvicorn).

    pdmesh gateway --model PATH [--served-model-name NAME] [--port 8000] [--api-key KEY]
                   [--max-queued-requests N]

``--model`` is read for its tokenizer and chat template only; the engines run elsewhere
and are found in the redis registry. Prints "gateway ready: {json}" once listening.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
from collections.abc import Iterator

import uvicorn

from pdmesh.services.gateway.app import GatewayState, create_app
from pdmesh.services.gateway.router import Router
from pdmesh.shared.infra.registry import Registry, add_registry_args
from pdmesh.shared.infra.tracing import Tracing, add_tracing_args
from pdmesh.shared.models.config import ModelConfig
from pdmesh.shared.models.tokenizer import Tokenizer
from pdmesh.shared.runtime.host import HostSettings, ServiceHost

log = logging.getLogger(__name__)

# httptools (C) parses HTTP/1.1 several times faster than h11, uvicorn's pure-Python
# fallback; the gateway writes one SSE event per token, so this is on the hot path.
HTTP_IMPL = "httptools" if importlib.util.find_spec("httptools") else "h11"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model folder (tokenizer, chat template)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--prefill-offload-threshold", type=int, default=0, metavar="TOKENS",
                   help="while every prefill instance has at least this many prompt tokens "
                        "queued, let a decode instance prefill new prompts itself (up to "
                        "half that backlog); 0: never (default; `pdmesh up` sets 2048, "
                        "its prefill and decode share one box)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="answer 429 (Retry-After) while this many requests are in flight "
                        "here (default: no limit)")
    p.add_argument("--log-requests", action="store_true",
                   help="log every finished request (detail: --log-requests-level)")
    p.add_argument("--log-requests-level", type=int, default=2, choices=(0, 1, 2, 3),
                   help="0 metadata, 1 + sampling parameters, 2 + the start of the input "
                        "and output, 3 + all of them")
    add_registry_args(p)
    add_tracing_args(p)


def run(a: argparse.Namespace) -> int:
    if a.max_queued_requests is not None and a.max_queued_requests < 1:
        raise ValueError(f"--max-queued-requests: must be >= 1, got {a.max_queued_requests}")
    if a.prefill_offload_threshold < 0:
        raise ValueError(f"--prefill-offload-threshold: must be >= 0, got "
                         f"{a.prefill_offload_threshold}")
    cfg = ModelConfig.from_folder(a.model)
    name = a.served_model_name or a.model
    settings = HostSettings("gateway", a.host, a.port, a.advertise_host, a.redis_url,
                            a.registry_prefix, model_name=name)
    with ServiceHost(settings) as host:
        router = Router(Registry(a.redis_url, a.registry_prefix), name,
                        offload_threshold=a.prefill_offload_threshold)
        router.start()
        tracing = Tracing.from_args("pdmesh-gateway", a)
        host.at_close(tracing.shutdown)  # exports the spans still buffered
        state = GatewayState(tokenizer=Tokenizer(a.model), router=router, model_name=name,
                             max_model_len=a.max_model_len or cfg.max_position_embeddings,
                             api_key=a.api_key, max_queued_requests=a.max_queued_requests,
                             tracing=tracing,
                             log_requests=a.log_requests_level if a.log_requests else None)
        sock = host.http_socket()
        server = _Uvicorn(uvicorn.Config(create_app(state), log_level="warning",
                                         lifespan="on", http=HTTP_IMPL))
        host.on_signal = server.stop
        host.register()
        host.ready(model=name)
        server.run(sockets=[sock])
    return 0


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the ServiceHost's stop it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def stop(self, count: int) -> None:
        """From a signal handler: flags only. A second signal stops at once."""
        self.should_exit = True
        if count > 1:
            self.force_exit = True
