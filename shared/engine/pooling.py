"""Embeddings from a decoder model: vLLM's pooling runner (``--runner pooling``,
``--convert embed``; SGLang's ``--is-embedding``).

A pooling request computes its prompt as any prompt is computed (chunked, batched with
the others) and, instead of a sampled token, ends with one vector: its prompt's final
(normed) hidden states pooled

    LAST   the last prompt token's row (vLLM's default for a causal LM)
    MEAN   the mean over every prompt row (computed whole: no prefix-cache hits)
    CLS    the first prompt row (computed whole)

then cut to ``dimensions`` (a Matryoshka model only) and L2-normalized when asked
(vLLM 0.32's ``use_activation``; its older spelling ``normalize`` is read in
--pooler-config and said to be the older one).
The defaults come from the checkpoint's sentence-transformers files (``modules.json``,
its Pooling module's ``config.json``, a Normalize module), as vLLM reads them, then
from ``--pooler-config`` over them. The step hook that pools is ``pooler.Pooler``;
this module imports no torch (an edge process reads ``Pooling``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
# --pooler-config keys that take effect; vLLM's others are named as without effect
POOLER_KEYS = ("pooling_type", "seq_pooling_type", "use_activation", "dimensions")
# sentence-transformers' Pooling config -> vLLM's pooling type
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True)
class Pooling:
    """How one request's prompt becomes its embedding."""

    type: str = "LAST"
    normalize: bool = True
    dimensions: int | None = None  # None: the model's hidden size

    def validate(self, hidden_size: int, matryoshka: bool) -> None:
        """ValueError naming the field."""
        if self.type not in POOLING_TYPES:
            raise ValueError(f"pooling_type: {self.type!r} is not one of "
                             f"{', '.join(POOLING_TYPES)}")
        if self.dimensions is None:
            return
        if not matryoshka:
            raise ValueError("dimensions: this model does not support Matryoshka "
                             "representation (its config names no matryoshka_dimensions)")
        if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) \
                or not 1 <= self.dimensions <= hidden_size:
            raise ValueError(f"dimensions: must be an integer in [1, {hidden_size}], got "
                             f"{self.dimensions!r}")

    @property
    def every_row(self) -> bool:
        """It reads every prompt row, so none may come from a cache."""
        return self.type != "LAST"


@dataclass(frozen=True)
class PoolingParams:
    """A request's own pooling fields, as vLLM's ``PoolingParams`` (None: the model's)."""

    dimensions: int | None = None
    use_activation: bool | None = None  # an embedding's: L2-normalized

    def over(self, default: Pooling) -> Pooling:
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation: must be true or false, got "
                             f"{self.use_activation!r}")
        return replace(default, dimensions=default.dimensions if self.dimensions is None
                       else self.dimensions,
                       normalize=default.normalize if self.use_activation is None
                       else self.use_activation)


def model_pooling(folder: str | Path, pooler_config: dict[str, Any] | None = None
                  ) -> tuple[Pooling, list[str]]:
    """The model's default pooling and what of ``pooler_config`` is without effect:
    its sentence-transformers files (when it ships them), ``--pooler-config`` over
    them. ValueError naming the key."""
    pooling = Pooling()
    folder = Path(folder)
    modules = _read_json(folder / "modules.json")
    if isinstance(modules, list):
        types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
        for m in modules:
            if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling"):
                st = _read_json(folder / str(m.get("path", "")) / "config.json") or {}
                mode = next((t for k, t in _ST_MODES.items() if st.get(k)), None)
                if mode is not None:
                    pooling = replace(pooling, type=mode)
        pooling = replace(pooling, normalize=any(t.endswith(".Normalize") for t in types))
    return with_pooler_config(pooling, pooler_config)


def with_pooler_config(pooling: Pooling, pooler_config: dict[str, Any] | None
                       ) -> tuple[Pooling, list[str]]:
    """``pooling`` with --pooler-config over it, and the keys without effect."""
    unused: list[str] = []
    for key, value in (pooler_config or {}).items():
        if key in ("pooling_type", "seq_pooling_type"):
            if not isinstance(value, str) or value.upper() not in POOLING_TYPES:
                raise ValueError(f"--pooler-config: {key} {value!r} is not one of "
                                 f"{', '.join(POOLING_TYPES)}")
            pooling = replace(pooling, type=value.upper())
        elif key in ("use_activation", "normalize"):  # (normalize: vLLM before 0.32)
            if not isinstance(value, bool):
                raise ValueError(f"--pooler-config: {key} must be true or false, got "
                                 f"{value!r}")
            pooling = replace(pooling, normalize=value)
        elif key == "dimensions":
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"--pooler-config: dimensions must be a positive "
                                 f"integer, got {value!r}")
            pooling = replace(pooling, dimensions=value)
        elif value is not None:
            unused.append(key)
    return pooling, unused


def is_matryoshka(folder: str | Path) -> bool:
    """The model says its embeddings may be cut short (vLLM reads the same keys)."""
    cfg = _read_json(Path(folder) / "config.json") or {}
    return bool(cfg.get("is_matryoshka") or cfg.get("matryoshka_dimensions"))


def _read_json(path: Path) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read: {e}") from None
