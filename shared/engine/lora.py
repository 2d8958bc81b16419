"""Many LoRA adapters on one base model, in one batch.

    host      adapters read from their folders, least recently used dropped past
              ``max_cpu_loras`` (one a running request uses is kept)
    device    ``max_loras`` slots: per site (a projection of a layer), every slot's A
              side by side, A_cat [in, slots * parts * r] (a part: q, k, v of a fused
              qkv ...; r = max_lora_rank, zero where an adapter has less), and per part
              every slot's B stacked, [slots * r, the part's width]
    a step    rows are marked with their request's slot (a base-model row with none);
              each site then adds, for the whole batch, over the slots in use (a new
              adapter takes the lowest free slot)

                  y = (x @ A_cat) * mask      a row keeps its slot's columns only
                  out[part] += y[part] @ B    one expand per part

so a batch mixing adapters and the base model costs one shrink and an expand per part of
each projection, whatever the number of adapters (``KernelBackend.lora_shrink_expand``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdmesh.shared.engine.lora_request import LoRARequest
from pdmesh.shared.models.lora import SITE_PARTS, Adapter, read_adapter

log = logging.getLogger(__name__)

SITES = tuple(SITE_PARTS)


class LoraStep:
    """One forward's LoRA: which slot each row runs (``mask`` [T, hi], one-hot, zero for
    a base row) over the slots in use, 0 .. hi - 1, and the slots' stacked weights."""

    def __init__(self, slots: LoraSlots, mask: torch.Tensor):
        self.slots = slots
        self.mask = mask
        self.hi = mask.shape[1]

    def apply(self, layer: int, site: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the rows' adapters' updates of ``site`` in ``layer`` to ``out`` [T, N]."""
        weights = self.slots.weights.get((layer, site))
        if weights is None or x.shape[0] == 0:
            return
        r, hi = self.slots.max_rank, self.hi
        # (the parts an adapter in the slots in use targets; none: nothing to add)
        on = [p for p, held in enumerate(weights.held) if any(s < hi for s in held)]
        if not on:
            return
        parts = len(weights.bs)
        self.slots.backend.lora_shrink_expand(
            x, weights.a_cat[:, :hi * parts * r], [weights.bs[p][:hi * r] for p in on],
            [weights.bounds[p] for p in on], self.mask, out, on)


@dataclass
class SiteSlots:
    """One site's slots: A of every slot side by side, ``a_cat`` [in, slots * parts * r]
    (slot, then part, then rank), and per part B stacked, [slots * r, that part's width];
    ``bounds``: each part's output columns."""

    a_cat: torch.Tensor
    bs: list[torch.Tensor]
    bounds: list[tuple[int, int]]
    held: list[set[int]] = field(default_factory=list)  # per part: the slots targeting it


class LoraSlots:
    """The device slots: every site of the model, ``num_slots`` adapters wide. A new
    adapter takes the lowest free slot, so a step computes over the few first slots
    when few adapters are in."""

    def __init__(self, model, backend, num_slots: int, max_rank: int):
        from pdmesh.shared.models.lora import site_shape, site_weight

        self.backend = backend
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.names: list[str | None] = [None] * num_slots  # the adapter in each slot
        self._used: OrderedDict[int, None] = OrderedDict()  # slots, least recent first
        dev, dtype = backend.device, model.dtype
        self.weights: dict[tuple[int, str], SiteSlots] = {}
        for i, lw in enumerate(model.w.layers):
            for site in SITES:
                if site_weight(lw, site) is None:
                    continue
                k, widths = site_shape(model, i, site)
                starts = [sum(widths[:p]) for p in range(len(widths))]
                self.weights[(i, site)] = SiteSlots(
                    torch.zeros(k, num_slots * len(widths) * max_rank, dtype=dtype,
                                device=dev),
                    [torch.zeros(num_slots * max_rank, w, dtype=dtype, device=dev)
                     for w in widths],
                    [(a, a + w) for a, w in zip(starts, widths, strict=True)],
                    [set() for _ in widths])

    def slot_of(self, name: str) -> int | None:
        return self.names.index(name) if name in self.names else None

    def place(self, adapters: list[Adapter]) -> dict[str, int]:
        """Slots for ``adapters`` (at most ``num_slots`` of them, the step's), loading
        those not in one over the least recently used others."""
        if len(adapters) > self.num_slots:
            raise ValueError(f"max_loras: a step needs {len(adapters)} adapters and there "
                             f"are {self.num_slots} slots")
        wanted = {a.name for a in adapters}
        placed: dict[str, int] = {}
        for adapter in adapters:
            slot = self.slot_of(adapter.name)
            if slot is None:
                slot = next(s for s in self._lru() if self.names[s] not in wanted)
                self._write(slot, adapter)
            placed[adapter.name] = slot
            self._used.pop(slot, None)
            self._used[slot] = None
        return placed

    def forget(self, name: str) -> None:
        """Free the slot of ``name`` (its adapter was unloaded)."""
        slot = self.slot_of(name)
        if slot is not None:
            self._clear(slot)
            self.names[slot] = None

    def _lru(self) -> list[int]:
        free = [s for s, n in enumerate(self.names) if n is None]
        return free + [s for s in self._used if self.names[s] is not None]

    def _clear(self, slot: int) -> None:
        r = self.max_rank
        for w in self.weights.values():
            parts = len(w.bs)
            w.a_cat[:, slot * parts * r:(slot + 1) * parts * r].zero_()
            for b, held in zip(w.bs, w.held, strict=True):
                b[slot * r:(slot + 1) * r].zero_()
                held.discard(slot)

    def _write(self, slot: int, adapter: Adapter) -> None:
        self._clear(slot)
        r = self.max_rank
        for key, w in self.weights.items():
            lora = adapter.sites.get(key)
            if lora is None:
                continue
            parts = len(w.bs)
            for part, (b_slots, ab) in enumerate(zip(w.bs, lora.parts, strict=True)):
                if ab is not None:
                    a, b = ab
                    cols = (slot * parts + part) * r
                    w.a_cat[:, cols:cols + a.shape[1]].copy_(a)
                    b_slots[slot * r:slot * r + b.shape[0]].copy_(b)
                    w.held[part].add(slot)
        self.names[slot] = adapter.name
        log.info("lora: adapter %s in slot %d", adapter.name, slot)


class LoraManager:
    """The engine's adapters: read on first use (or ``load``), kept in host memory up to
    ``max_cpu_loras``, placed in the device slots for the steps that run them."""

    def __init__(self, model, backend, max_loras: int, max_rank: int, max_cpu_loras: int):
        if max_loras < 1:
            raise ValueError(f"max_loras: must be at least 1, got {max_loras}")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras: must be at least max_loras ({max_loras}), "
                             f"got {max_cpu_loras}")
        self.model = model
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.slots = LoraSlots(model, backend, max_loras, max_rank)
        self._host: OrderedDict[str, Adapter] = OrderedDict()  # least recent first
        self._paths: dict[str, str] = {}  # name -> folder, of every adapter known
        # unloaded while requests ran them: gone once they are done
        self._retiring: set[str] = set()
        # the adapters the engine's requests run (set by the engine)
        self.in_use: Callable[[], set[str]] = set

    @property
    def max_loras(self) -> int:
        return self.slots.num_slots

    def names(self) -> list[str]:
        """The adapters loaded (those unloaded while requests run them are not)."""
        return [n for n in self._paths if n not in self._retiring]

    def held(self) -> list[str]:
        """The loaded adapters in host memory: a request for one reads nothing. (Read
        from the heartbeat's thread: the copies are each made under the GIL.)"""
        host, retiring = list(self._host), set(self._retiring)
        return [n for n in host if n not in retiring]

    def request(self, name: str, path: str | None = None) -> LoRARequest:
        """The LoRARequest of an adapter known here, or of the one ``path`` holds (read
        when a request first runs it: how an instance that has not loaded an adapter
        the mesh serves takes it); ValueError naming ``model`` when neither."""
        if self._retiring:
            self._settle()
        # (one being unloaded runs only a request the mesh admitted with its folder)
        known = None if name in self._retiring and not path else self._paths.get(name)
        if known is None and not path:
            raise ValueError(f"model: the LoRA adapter {name!r} is not loaded here")
        ids = list(self._paths)  # (its id: its place among them, from 1)
        return LoRARequest(name, ids.index(name) + 1 if name in self._paths else len(ids) + 1,
                           known or path)

    def add(self, request: LoRARequest) -> Adapter:
        """Load an adapter now (vLLM's load_lora_adapter): read, checked and kept in
        host memory; one being unloaded is loaded again."""
        adapter = self.load(request)
        self._retiring.discard(request.lora_name)
        return adapter

    def load(self, request: LoRARequest) -> Adapter:
        """The adapter, read now unless held (ValueError naming what does not fit; a
        name already bound to another folder is refused)."""
        known = self._paths.get(request.lora_name)
        if known is not None and known != request.lora_path:
            raise ValueError(f"lora_name: {request.lora_name!r} is already loaded from "
                             f"{known}")
        adapter = self._host.get(request.lora_name)
        if adapter is None:
            adapter = read_adapter(request.lora_name, request.lora_path, self.model,
                                   self.max_rank, self.model.dtype)
            self._host[request.lora_name] = adapter
            self._paths[request.lora_name] = request.lora_path
            self._evict_host(keep=request.lora_name)
        self._host.move_to_end(request.lora_name)
        return adapter

    def unload(self, name: str) -> None:
        """Forget an adapter (KeyError when it is not loaded). Requests running it
        finish with it; it is gone once they are done."""
        if name not in self._paths or name in self._retiring:
            raise KeyError(name)
        self._retiring.add(name)
        self._settle()

    def _settle(self) -> None:
        """Drop the unloaded adapters no request runs any more."""
        done = self._retiring - self.in_use()
        for name in done:
            self._paths.pop(name)
            self._host.pop(name, None)
            self.slots.forget(name)
        self._retiring -= done

    def _evict_host(self, keep: str) -> None:
        running = self.in_use() | {keep}
        while len(self._host) > self.max_cpu_loras:
            victim = next((n for n in self._host if n not in running
                           and self.slots.slot_of(n) is None), None)
            if victim is None:
                victim = next((n for n in self._host if n not in running), None)
            if victim is None:
                return  # every held adapter runs: over the limit until one is done
            self._host.pop(victim)
            self.slots.forget(victim)

    def step(self, row_adapters: list[str | None], device: torch.device) -> LoraStep | None:
        """The LoRA of a forward whose rows run ``row_adapters`` (None: the base model);
        None when no row runs one."""
        if self._retiring:
            self._settle()
        names = list(dict.fromkeys(n for n in row_adapters if n is not None))
        if not names:
            return None
        adapters = []
        for n in names:
            adapter = self._host.get(n)
            if adapter is None:  # dropped from host memory meanwhile: read it again
                adapter = self.load(LoRARequest(n, 1, self._paths[n]))
            adapters.append(adapter)
        placed = self.slots.place(adapters)
        hi = max(placed.values()) + 1  # (the slots in use: 0 .. hi - 1)
        index = torch.tensor([placed[n] if n is not None else -1 for n in row_adapters])
        mask = torch.zeros(len(row_adapters), hi + 1)
        mask[torch.arange(len(row_adapters)), index] = 1.0  # (-1: the spare column)
        return LoraStep(self.slots, mask[:, :hi].to(device, self.model.dtype))
