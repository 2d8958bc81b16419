"""Which quantization a checkpoint carries, read from its own files.

A quantized checkpoint read as if it were not would cast int8 (or FP8) weights to the
model's dtype without their scales and answer garbage without a word; so the loader
asks here first, and refuses what it cannot load, naming the format. What says a
checkpoint is quantized, in the order asked:

    modelslim      ``quant_model_description.json`` beside the weights (vLLM-Ascend's
                   and SGLang's ``--quantization ascend`` read it): each weight's type,
                   W8A8 / W8A8_DYNAMIC / W4A8_DYNAMIC / FLOAT, and ``model_quant_type``
    config         ``quantization_config`` in config.json (``quant_method``: fp8 with its
                   ``weight_block_size`` as DeepSeek ships V3 / V4, awq, gptq,
                   compressed-tensors, ...), as vLLM auto-detects it
    tensors        a weight stored as an integer or FP8 type, or a scale beside it
                   (``weight_scale``, ``weight_scale_inv``, ``deq_scale``, ``input_scale``,
                   ``weight_offset``; DeepSeek-V4's ``.scale``) with neither of the above
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DESCRIPTION = "quant_model_description.json"
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".deq_scale", ".input_scale",
                  ".weight_offset", ".input_offset", ".quant_bias", ".scale")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclass(frozen=True)
class QuantFormat:
    name: str  # "modelslim", the config's quant_method, or "quantized tensors"
    evidence: str  # what says so, for the error message
    flag: str | None  # the flag vLLM serves it with, where one is needed


def detect(folder: str | Path, dtypes: dict[str, str]) -> QuantFormat | None:
    """The quantization of the checkpoint in ``folder`` (None: plain floats).
    ``dtypes``: tensor name -> its safetensors dtype ("F32", "I8", "F8_E4M3", ...)."""
    folder = Path(folder)
    description = folder / DESCRIPTION
    if description.exists():
        return _modelslim(description)
    config = json.loads((folder / "config.json").read_text())
    quant = config.get("quantization_config")
    if quant:
        method = str(quant.get("quant_method", "unknown")) if isinstance(quant, dict) \
            else "unknown"
        details = ", ".join(f"{key} {quant[key]}" for key in
                            ("weight_block_size", "bits", "fmt", "activation_scheme")
                            if isinstance(quant, dict) and key in quant)
        return QuantFormat(method, f"config.json quantization_config: quant_method {method}"
                           + (f", {details}" if details else ""), None)
    for name, dtype in dtypes.items():
        if dtype not in FLOAT_DTYPES and name.endswith("weight"):
            return QuantFormat("quantized tensors", f"{name} is stored as {dtype}", None)
    for name in dtypes:
        if name.endswith(SCALE_SUFFIXES):
            return QuantFormat("quantized tensors", f"it has scale tensors ({name})", None)
    return None


def _modelslim(description: Path) -> QuantFormat:
    try:
        kinds = json.loads(description.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"model: {description} is not valid JSON ({e})") from e
    if not isinstance(kinds, dict):
        raise ValueError(f"model: {description} must be an object of weight name -> type")
    overall = kinds.get("model_quant_type")
    types = sorted({str(v) for k, v in kinds.items() if k != "model_quant_type"
                    and isinstance(v, str)})
    what = f"{DESCRIPTION}: " + (f"model_quant_type {overall}, " if overall else "") + \
        f"weight types {', '.join(types) or 'none'}"
    return QuantFormat("modelslim", what, "--quantization ascend")


def refusal(folder: str | Path, fmt: QuantFormat) -> ValueError:
    """The start-up error for a quantized checkpoint pdmesh does not load."""
    served = f" (vLLM-Ascend serves it with {fmt.flag})" if fmt.flag else ""
    return ValueError(f"model: {folder} is a {fmt.name} checkpoint ({fmt.evidence}){served}; "
                      f"pdmesh does not load quantized weights yet and refuses them rather "
                      f"than read them as floats without their scales")
