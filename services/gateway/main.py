"""`pdmesh gateway`: the OpenAI-compatible HTTP front of the mesh (FastAPI + uvicorn).

    pdmesh gateway --model PATH [--served-model-name NAME] [--port 8000] [--api-key KEY]
                   [--max-queued-requests N]

``--model`` is read for its tokenizer and chat template only; the engines run elsewhere
and are found in the redis registry. Prints "gateway ready: {json}" once listening.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Iterator

import uvicorn

from pdmesh.services.gateway.app import GatewayState, create_app
from pdmesh.services.gateway.chat_output import OutputSettings
from pdmesh.services.gateway.constraints import grammar_in_reasoning, reasoning_parser_named
from pdmesh.services.gateway.named import NamedInstances
from pdmesh.services.gateway.router import Router
from pdmesh.shared.config.lora_flags import lora_modules
from pdmesh.shared.config.serve import ServeConfig, api_key
from pdmesh.shared.engine.generation_defaults import default_sampling
from pdmesh.shared.infra.registry import Registry
from pdmesh.shared.infra.timeouts import rpc_timeout_s
from pdmesh.shared.infra.tracing import Tracing
from pdmesh.shared.models.config import ModelConfig
from pdmesh.shared.models.tokenizer import Tokenizer, load_chat_template
from pdmesh.shared.runtime.host import HostSettings, ServiceHost

log = logging.getLogger(__name__)

# httptools (C) parses HTTP/1.1 several times faster than h11, uvicorn's pure-Python
# fallback; the gateway writes one SSE event per token, so this is on the hot path.
HTTP_IMPL = "httptools" if importlib.util.find_spec("httptools") else "h11"


def run(a: ServeConfig) -> int:
    _check(a)
    in_reasoning = grammar_in_reasoning(a.structured_outputs_config)
    reasoning = reasoning_parser_named(a.structured_outputs_config, a.reasoning_parser)
    key = api_key(a)
    cfg = ModelConfig.from_folder(a.model, a.hf_overrides)
    name = a.model_name
    settings = HostSettings("gateway", a.host, a.port, a.advertise_host, a.redis_url,
                            a.registry_prefix, model_name=name,
                            metrics_names=a.metrics_names)
    with ServiceHost(settings) as host:
        router = _router(a, name)
        router.start()
        host.at_close(router.stop)
        _serve_adapters(router, dict(lora_modules(a)))
        tracing = Tracing.from_args("pdmesh-gateway", a)
        host.at_close(tracing.shutdown)  # exports the spans still buffered
        output = OutputSettings(tool_call_parser=a.tool_call_parser,
                                auto_tool_choice=a.enable_auto_tool_choice,
                                reasoning_parser=reasoning,
                                grammar_in_reasoning=in_reasoning)
        tokenizer = Tokenizer(a.tokenizer or a.model, a.tokenizer_mode,
                              load_chat_template(a.chat_template))
        defaults = _sampling_defaults(a)
        state = GatewayState(tokenizer=tokenizer, router=router,
                             model_name=name, output=output, model_path=str(a.model),
                             model_names=a.served_model_name or (name,),
                             max_model_len=a.max_model_len or cfg.max_position_embeddings,
                             api_key=key, max_queued_requests=a.max_queued_requests,
                             tracing=tracing,
                             log_requests=a.log_requests_level if a.enable_log_requests else None,
                             max_body_bytes=a.max_request_body_bytes,
                             body_timeout_s=a.request_body_timeout,
                             stall_timeout_s=a.stall_timeout,
                             rpc_timeout_s=rpc_timeout_s(),
                             trust_request_chat_template=a.trust_request_chat_template,
                             sampling_defaults=defaults,
                             instance_grace_s=a.instance_grace,
                             metrics_names=a.metrics_names,
                             eos_token_ids=cfg.eos_token_ids,
                             force_include_usage=a.enable_force_include_usage,
                             stream_interval=a.stream_interval,
                             return_hidden_states=a.enable_return_hidden_states)
        sock = host.http_socket()
        server = _Uvicorn(uvicorn.Config(create_app(state), log_level="warning",
                                         lifespan="on", http=HTTP_IMPL))
        host.on_signal = server.stop
        host.register()
        host.ready(model=name)
        server.run(sockets=[sock])
    return 0


def _serve_adapters(router: Router, adapters: dict[str, str]) -> None:
    """The mesh serves the --lora-modules adapters (one of the same name another
    gateway serves from elsewhere stays as it is, said)."""
    served = router.adapters()
    for name, path in adapters.items():
        if not router.serve_adapter(name, path) and served.get(name, path) != path:
            log.warning("--lora-modules: the mesh already serves an adapter %r, from %s; "
                        "that one stays (not %s)", name, served[name], path)


def _check(a: ServeConfig) -> None:
    """ValueError naming the flag for a value the gateway cannot run with."""
    if a.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes: must be >= 1, got "
                         f"{a.max_request_body_bytes}")
    if not a.stall_timeout > 0:
        raise ValueError(f"--stall-timeout: must be > 0, got {a.stall_timeout}")
    if not a.instance_grace >= 0:
        raise ValueError(f"--instance-grace: must be >= 0, got {a.instance_grace}")
    if not a.request_body_timeout > 0:
        raise ValueError(f"--request-body-timeout: must be > 0, got {a.request_body_timeout}")
    if a.enable_auto_tool_choice and not a.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice: needs --tool-call-parser (how the "
                         "model's tool calls are read)")


def _sampling_defaults(a: ServeConfig) -> dict:
    """A request's default sampling fields (vLLM's --generation-config, said at start-up
    as vLLM says it)."""
    defaults, warnings = default_sampling(a.model, a.generation_config,
                                          a.override_generation_config,
                                          a.preferred_sampling_params)
    for w in warnings:
        log.warning("%s", w)
    if defaults:
        log.warning("default sampling parameters from the model's generation config (and "
                    "the overrides): %s; relaunch with --generation-config vllm for "
                    "none", defaults)
    return defaults


def _router(a: ServeConfig, name: str) -> Router:
    """The router over the instances a proxy line names (pdmesh proxy), else over the
    registry's."""
    named = a.prefill_addresses or a.decode_addresses
    found = (NamedInstances(a.prefill_addresses, a.decode_addresses) if named
             else Registry(a.redis_url, a.registry_prefix))
    return Router(found, name,  # type: ignore[arg-type]
                  offload_threshold=a.prefill_offload_threshold,
                  decode_tpot_slo_ms=a.decode_tpot_slo_ms, stall_timeout_s=a.stall_timeout)


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
