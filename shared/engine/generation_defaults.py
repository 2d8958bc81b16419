"""The default sampling parameters a served model's requests start from, as vLLM takes
them: ``--generation-config auto`` (its default) reads the model's
``generation_config.json`` for ``repetition_penalty``, ``temperature``, ``top_k``,
``top_p``, ``min_p`` and ``max_new_tokens`` (as max_tokens), ``vllm`` reads none, a
folder reads that folder's; ``--override-generation-config`` (JSON) is laid over them,
and SGLang's ``--preferred-sampling-params`` (JSON, its names) over that. A request's own
value wins, but for max_tokens: the default max_new_tokens caps it, as vLLM's
get_max_tokens takes the least of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json's name -> SamplingParams' (vLLM's get_diff_sampling_param)
FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature",
          "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
          "max_new_tokens": "max_tokens"}


def default_sampling(model: str | Path, source: str = "auto",
                     override: dict[str, Any] | None = None,
                     preferred: dict[str, Any] | None = None
                     ) -> tuple[dict[str, Any], list[str]]:
    """(SamplingParams fields -> their defaults, warnings for keys without effect).
    ValueError naming the flag for a folder without a generation_config.json or a value
    a request could not carry either."""
    found: dict[str, Any] = {}
    if source != "vllm":
        folder = Path(model) if source == "auto" else Path(source)
        path = folder / "generation_config.json"
        if path.is_file():
            found = json.loads(path.read_text())
        elif source != "auto":
            raise ValueError(f"--generation-config: {path} not found (give 'auto', 'vllm' "
                             "or a folder holding a generation_config.json)")
    warnings: list[str] = []
    out = {FIELDS[k]: v for k, v in found.items() if k in FIELDS and v is not None}
    for flag, given in (("--override-generation-config", override),
                        ("--preferred-sampling-params", preferred)):
        if given is None:
            continue
        if not isinstance(given, dict):
            raise ValueError(f"{flag}: must be a JSON object, got {given!r}")
        idle = sorted(k for k in given if k not in FIELDS and k not in FIELDS.values())
        if idle:
            warnings.append(f"{flag}: without effect: {', '.join(idle)} (default sampling "
                            f"parameters are {', '.join(FIELDS)})")
        out.update({FIELDS.get(k, k): v for k, v in given.items()
                    if k in FIELDS or k in FIELDS.values()})
    from pdmesh.shared.engine.sampling_params import SamplingParams

    try:
        SamplingParams(**out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--generation-config / --override-generation-config: {e}") from None
    return out, warnings
