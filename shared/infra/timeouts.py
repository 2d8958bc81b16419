"""Timeouts vLLM's environment variables set, read where the processes need them (the
gateway's wait on its instances, the ranks' collectives); shared/config/environment.py
says what each recipe variable does."""

from __future__ import annotations

import os
from collections.abc import Mapping


def _positive(env: Mapping[str, str], name: str, scale: float) -> float | None:
    text = env.get(name)
    if text is None or not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}: must be a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"{name}: must be > 0, got {text!r}")
    return value * scale


def rpc_timeout_s(env: Mapping[str, str] | None = None, default: float = 600.0) -> float:
    """How long the gateway waits on an instance (a prefill call, a decode stream's
    silence): vLLM's VLLM_RPC_TIMEOUT, in milliseconds, else ``default`` seconds."""
    value = _positive(os.environ if env is None else env, "VLLM_RPC_TIMEOUT", 1e-3)
    return default if value is None else value


def collective_timeout_s(env: Mapping[str, str] | None = None, default: float = 120.0
                         ) -> float:
    """How long a rank's collectives wait for the others (vLLM's
    VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, else ``default``)."""
    value = _positive(os.environ if env is None else env,
                      "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", 1.0)
    return default if value is None else value
