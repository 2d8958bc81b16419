"""`pdmesh gateway`: the OpenAI-compatible HTTP front of the mesh (FastAPI + uvicorn).

    pdmesh gateway --model PATH [--served-model-name NAME] [--port 8000] [--api-key KEY]
                   [--max-queued-requests N]

``--model`` is read for its tokenizer and chat template only; the engines run elsewhere
and are found in the redis registry. Prints "gateway ready: {json}" once listening.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import socket

import uvicorn

from pdmesh.services.gateway.app import GatewayState, create_app
from pdmesh.services.gateway.router import Router
from pdmesh.shared.infra.registry import (
    Heartbeat,
    Instance,
    Registry,
    add_registry_args,
    advertised_host,
)
from pdmesh.shared.infra.tracing import Tracing, add_tracing_args
from pdmesh.shared.models.config import ModelConfig
from pdmesh.shared.models.tokenizer import Tokenizer

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
    cfg = ModelConfig.from_folder(a.model)
    name = a.served_model_name or a.model
    registry = Registry(a.redis_url, a.registry_prefix)
    if a.prefill_offload_threshold < 0:
        raise ValueError(f"--prefill-offload-threshold: must be >= 0, got "
                         f"{a.prefill_offload_threshold}")
    router = Router(registry, name, offload_threshold=a.prefill_offload_threshold)
    router.start()
    state = GatewayState(tokenizer=Tokenizer(a.model), router=router,
                         model_name=name,
                         max_model_len=a.max_model_len or cfg.max_position_embeddings,
                         api_key=a.api_key, max_queued_requests=a.max_queued_requests,
                         tracing=Tracing.from_args("pdmesh-gateway", a),
                         log_requests=a.log_requests_level if a.log_requests else None)
    app = create_app(state)
    # IPPROTO_TCP named explicitly: asyncio only sets TCP_NODELAY on sockets whose proto
    # says TCP, and without it Nagle holds each SSE event behind the client's delayed ACK
    # (~40 ms stalls). Accepted sockets inherit TCP_NODELAY from the listener on Linux.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((a.host, a.port))
    sock.listen(2048)  # connections queue until uvicorn accepts them
    port = sock.getsockname()[1]
    host = advertised_host(a.host, a.advertise_host)
    beat = Heartbeat(registry, Instance(Heartbeat.new_id("gateway"), "gateway",
                                        f"{host}:{port}", name))
    beat.start()
    print("gateway ready: " + json.dumps({"http": f"http://{host}:{port}", "model": name}),
          flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", http=HTTP_IMPL))
    try:
        server.run(sockets=[sock])
    finally:
        beat.stop()
        state.tracing.shutdown()  # exports the spans still buffered
    return 0
