"""Models: config.json parsing, safetensors loading, the decoder, tokenizers, tiny models."""

from pdmesh.shared.models.config import ModelConfig, parse_dtype
from pdmesh.shared.models.loader import load_model
from pdmesh.shared.models.tokenizer import Tokenizer

__all__ = ["ModelConfig", "Tokenizer", "load_model", "parse_dtype"]
