"""The engine every prefill and decode worker runs: paged KV cache, prefix caching,
continuous batching with chunked prefill and preemption, sampling, and an offline API
shaped like vLLM's (``LLM``, ``SamplingParams``)."""

import importlib

# Loaded on first use (PEP 562): a gRPC edge process imports the engine's light modules
# (requests, sampling parameters: the engine protocol's types) without torch.
_EXPORTS = {
    "EngineConfig": "pdmesh.shared.engine.config",
    "EngineCore": "pdmesh.shared.engine.engine",
    "build_engine": "pdmesh.shared.engine.build",
    "LLM": "pdmesh.shared.engine.llm",
    "CompletionOutput": "pdmesh.shared.engine.llm",
    "RequestOutput": "pdmesh.shared.engine.llm",
    "Logprob": "pdmesh.shared.engine.request",
    "LoRARequest": "pdmesh.shared.engine.lora_request",
    "Request": "pdmesh.shared.engine.request",
    "RequestStatus": "pdmesh.shared.engine.request",
    "SamplingParams": "pdmesh.shared.engine.sampling_params",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdmesh.shared.engine' has no attribute {name!r}")


__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineCore",
    "Logprob",
    "LoRARequest",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "build_engine",
]
