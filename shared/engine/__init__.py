"""The engine every prefill and decode worker runs: paged KV cache, prefix caching,
continuous batching with chunked prefill and preemption, sampling, and an offline API
shaped like vLLM's (``LLM``, ``SamplingParams``)."""

from shared.engine.config import EngineConfig
from shared.engine.engine import EngineCore
from shared.engine.llm import LLM, CompletionOutput, RequestOutput
from shared.engine.request import Logprob, Request, RequestStatus
from shared.engine.sampling_params import SamplingParams

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
