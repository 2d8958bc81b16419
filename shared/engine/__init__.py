"""The engine every prefill and decode worker runs: paged KV cache, prefix caching,
continuous batching with chunked prefill and preemption, sampling, and an offline API
shaped like vLLM's (``LLM``, ``SamplingParams``)."""

import importlib

# Loaded on first use (PEP 562): a gRPC edge process imports the engine's light modules
# (requests, sampling parameters, the loop's stream types) without torch.
_EXPORTS = {
    "EngineConfig": "shared.engine.config",
    "EngineCore": "shared.engine.engine",
    "LLM": "shared.engine.llm",
    "CompletionOutput": "shared.engine.llm",
    "RequestOutput": "shared.engine.llm",
    "Logprob": "shared.engine.request",
    "Request": "shared.engine.request",
    "RequestStatus": "shared.engine.request",
    "SamplingParams": "shared.engine.sampling_params",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'shared.engine' has no attribute {name!r}")


__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineCore",
    "Logprob",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
]
