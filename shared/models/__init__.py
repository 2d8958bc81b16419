"""Models: config.json parsing, safetensors loading, the decoder, tokenizers, tiny models.

The names below load on first use (PEP 562): the gateway reads configs and tokenizers
without importing torch, which the loader needs."""

import importlib

_EXPORTS = {
    "ModelConfig": "pdmesh.shared.models.config",
    "parse_dtype": "pdmesh.shared.models.config",
    "load_model": "pdmesh.shared.models.loader",
    "Tokenizer": "pdmesh.shared.models.tokenizer",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdmesh.shared.models' has no attribute {name!r}")


__all__ = ["ModelConfig", "Tokenizer", "load_model", "parse_dtype"]
