"""vLLM's --cpu-offload-gb: up to that many GiB of the decoder layers' weights live in
host memory (pinned where the device allows it) instead of on the device, and each
forward copies a layer's weights over as it reaches the layer. It trades a copy per
layer per step for device memory, as vLLM's does: the KV cache gets the room.

Layers are offloaded from the first on while they fit the budget. A forward sees
``model.w.layers`` as a list whose offloaded entries come out as fresh device copies
(``StreamedLayers``); the rest of the model is untouched. Weights that change in place
(expert parallelism's EPLB moves, fine-grained TP's groups, tensor parallelism's ranks)
and captured decode graphs do not mix with it: refused or said at start-up. On cpu the
weights are in host memory already: without effect.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pdmesh.shared.models.transformer import weight_bytes

log = logging.getLogger(__name__)

GIB = 1 << 30


def map_weights(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A copy of ``obj`` (dataclasses, lists, tuples, dicts of tensors) with every tensor
    replaced by ``fn(tensor)``; one tensor reached twice is mapped once."""
    done: dict[int, torch.Tensor] = {}

    def walk(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            if id(o) not in done:
                done[id(o)] = fn(o)
            return done[id(o)]
        if isinstance(o, list):
            return [walk(x) for x in o]
        if isinstance(o, tuple):
            return type(o)(*(walk(x) for x in o)) if hasattr(o, "_fields") \
                else tuple(walk(x) for x in o)
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            out = copy.copy(o)
            for f in dataclasses.fields(o):
                object.__setattr__(out, f.name, walk(getattr(o, f.name)))
            return out
        return o

    return walk(obj)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    host = t.detach().to("cpu")
    try:
        return host.pin_memory()  # (async copies back; pageable where it cannot)
    except RuntimeError:
        return host


class StreamedLayers(list):
    """``model.w.layers`` with some entries kept in host memory: indexing or iterating
    gives those as copies on ``device`` (made as the forward reaches them)."""

    def __init__(self, layers: list[Any], offloaded: set[int], device: str):
        super().__init__(layers)
        self.offloaded = frozenset(offloaded)
        self.device = device

    def _on_device(self, i: int, layer: Any) -> Any:
        if i not in self.offloaded:
            return layer
        return map_weights(layer, lambda t: t.to(self.device, non_blocking=True))

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = i + len(self) if i < 0 else i
        return self._on_device(i, super().__getitem__(i))

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self[i]


def offload_layers(model: Any, budget_bytes: int, device: str) -> int:
    """Move the first layers that fit ``budget_bytes`` to host memory; returns the bytes
    moved. ``model.w.layers`` becomes a StreamedLayers."""
    layers = list(model.w.layers)
    offloaded: set[int] = set()
    moved = 0
    for i, layer in enumerate(layers):
        size = weight_bytes(layer)
        if moved + size > budget_bytes:
            break
        layers[i] = map_weights(layer, _to_host)
        offloaded.add(i)
        moved += size
    model.w.layers = StreamedLayers(layers, offloaded, device)
    accelerator = getattr(torch, device, None)  # (torch.cuda; torch.npu with torch_npu)
    if device != "cpu" and hasattr(accelerator, "empty_cache"):
        accelerator.empty_cache()  # the freed room to the KV cache's sizing
    log.info("cpu offload: %d of %d layers (%.2f GiB) in host memory, copied to %s per "
             "forward", len(offloaded), len(layers), moved / GIB, device)
    return moved


def check_offload(config: Any) -> None:
    """ValueError naming --cpu-offload-gb for a layout it does not mix with."""
    gb = config.cpu_offload_gb
    if not gb:
        return
    if gb < 0:
        raise ValueError(f"--cpu-offload-gb: must be >= 0, got {gb}")
    for on, what in ((config.tensor_parallel_size > 1, "tensor parallelism"),
                     (config.enable_expert_parallel, "expert parallelism"),
                     (bool(config.finegrained_tp_config), "fine-grained TP")):
        if on:
            raise ValueError(f"--cpu-offload-gb: not with {what} (its weights are "
                             f"sharded or moved in place on the device)")
