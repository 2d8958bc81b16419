"""Which decode steps run from captured graphs: vLLM's ``--enforce-eager`` and
``--compilation-config`` (``cudagraph_mode``, ``cudagraph_capture_sizes``,
``max_cudagraph_capture_size``), SGLang's ``--disable-cuda-graph``, ``--cuda-graph-bs``,
``--cuda-graph-max-bs`` and ``--disable-cuda-graph-padding``. No torch here: the
config check reads it (the capture itself: ``decode_graphs``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
# --compilation-config keys that take effect; the rest are listed without effect
RUN_KEYS = ("cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size",
            "cudagraph_num_of_warmups", "full_cuda_graph")
MAX_DEFAULT_SIZE = 512  # vLLM's bound on the default capture sizes


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's: 1, 2, 4, the multiples of 8 below 256, then of 16, up to ``max_size``."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]
    return [s for s in sizes if s <= max_size]


@dataclass(frozen=True)
class GraphConfig:
    """What is captured: ``mode`` NONE runs every step eagerly; any other captures
    decode steps of up to ``sizes[-1]`` sequences (padded to the next of ``sizes``;
    ``pad`` False: only a step of exactly a capture size replays, SGLang's
    ``--disable-cuda-graph-padding``)."""

    mode: str = "FULL_AND_PIECEWISE"
    sizes: tuple[int, ...] = ()
    pad: bool = True
    warmups: int = 1
    warnings: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.mode != "NONE" and bool(self.sizes)

    def size_for(self, batch: int) -> int | None:
        """The capture size a decode step of ``batch`` sequences runs at (None: eager)."""
        for s in self.sizes:
            if s >= batch:
                return s if self.pad or s == batch else None
        return None

    @classmethod
    def from_flags(cls, max_num_seqs: int, enforce_eager: bool = False,
                   compilation_config: Mapping[str, Any] | None = None,
                   disable_padding: bool = False) -> GraphConfig:
        """vLLM's ``--enforce-eager`` and ``--compilation-config`` (SGLang's flags are
        spelled as these); ValueError naming the bad key."""
        comp = dict(compilation_config or {})
        warnings: list[str] = []
        mode = comp.get("cudagraph_mode")
        asked = mode is not None or bool(comp.get("full_cuda_graph"))
        if mode is None:
            mode = "FULL" if comp.get("full_cuda_graph") else "FULL_AND_PIECEWISE"
        if not isinstance(mode, str) or mode.upper() not in MODES:
            raise ValueError(f"compilation_config.cudagraph_mode: must be one of "
                             f"{', '.join(MODES)}, got {mode!r}")
        mode = mode.upper()
        if asked and mode not in ("NONE", "PIECEWISE") and not enforce_eager:
            warnings.append(f"compilation_config.cudagraph_mode {mode}: decode steps are "
                            "captured piecewise (attention runs between the pieces); "
                            "prefill and mixed steps run eagerly")
        idle = sorted(set(comp) - set(RUN_KEYS))
        if idle:
            warnings.append("compilation_config: without effect (pdmesh does not "
                            f"torch.compile): {', '.join(idle)}")
        warmups = comp.get("cudagraph_num_of_warmups", 1)
        if not _whole(warmups, 0):
            raise ValueError(f"compilation_config.cudagraph_num_of_warmups: must be an "
                             f"integer >= 0, got {warmups!r}")
        cap = comp.get("max_cudagraph_capture_size")
        if cap is not None and not _whole(cap, 1):
            raise ValueError(f"compilation_config.max_cudagraph_capture_size: must be an "
                             f"integer >= 1, got {cap!r}")
        sizes = comp.get("cudagraph_capture_sizes")
        if sizes is None:
            sizes = default_capture_sizes(min(cap or MAX_DEFAULT_SIZE, max_num_seqs))
        else:
            if not isinstance(sizes, list | tuple) or not sizes or not all(
                    _whole(s, 1) for s in sizes):
                raise ValueError(f"compilation_config.cudagraph_capture_sizes: must be a "
                                 f"list of integers >= 1, got {sizes!r}")
            sizes = [s for s in sizes if cap is None or s <= cap]
            over = sorted({s for s in sizes if s > max_num_seqs})
            if over:
                warnings.append(f"compilation_config.cudagraph_capture_sizes: {over} exceed "
                                f"max_num_seqs ({max_num_seqs}), never reached: not captured")
                sizes = [s for s in sizes if s <= max_num_seqs]
        return cls("NONE" if enforce_eager else mode, tuple(sorted(set(sizes))),
                   not disable_padding, warmups, tuple(warnings))


def _whole(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
