"""Many LoRA adapters on one base model, in one batch.

    host      adapters read from their folders, least recently used dropped past
              ``max_cpu_loras`` (one a running request uses is kept)
    device    ``max_loras`` slots: per site (a projection of a layer), every slot's A,
              [slots, in, parts * r] (a part: q, k, v of a fused qkv ...; r =
              max_lora_rank, zero where an adapter has less), and per part every slot's
              B, [slots, r, the part's width]
    a step    its rows are grouped by their request's slot (a base-model row in none):
              ``rows`` [slots it runs, m], each slot's rows, padded to the largest
              group; each site then adds, for the whole batch, over the slots it runs
              (their weights gathered unless they are the first slots: a step reads the
              adapters it runs, not every one in a slot)

                  y = x[rows] @ A           each group by its own slot's A (one bmm)
                  out[rows, part] += y[part] @ B     one bmm per part

so a batch mixing adapters and the base model costs one shrink and an expand per part of
each projection, whatever the number of adapters, and each row meets its own adapter's
weights only (``KernelBackend.lora_shrink_expand``).
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
# a slot's rows past this many (a prefill's) are cut in groups, so the padding to the
# largest group stays small
CHUNK = 64


class LoraStep:
    """One forward's LoRA: its rows in groups of one slot each (``groups``, their slots;
    ``rows`` [groups, m], padded; ``valid`` [groups, m, 1] marks the real ones)."""

    def __init__(self, slots: LoraSlots, groups: list[int], rows: torch.Tensor,
                 valid: torch.Tensor):
        self.slots = slots
        self.used = set(groups)
        self.rows = rows
        self.valid = valid
        # the slots' weights: a prefix of them where the groups are slots 0 .. n - 1,
        # else gathered (a copy of what the step reads, rather than reading every slot)
        self._index = None if groups == list(range(len(groups))) else \
            torch.tensor(groups, device=rows.device)

    def _take(self, w: torch.Tensor) -> torch.Tensor:
        return w[:self.rows.shape[0]] if self._index is None else w.index_select(0, self._index)

    def apply(self, layer: int, site: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the rows' adapters' updates of ``site`` in ``layer`` to ``out`` [T, N]."""
        weights = self.slots.weights.get((layer, site))
        if weights is None or x.shape[0] == 0:
            return
        # (the parts an adapter the step runs targets; none: nothing to add)
        on = [p for p, held in enumerate(weights.held) if held & self.used]
        if not on:
            return
        take = self._take
        self.slots.backend.lora_shrink_expand(
            x, take(weights.a), [take(weights.bs[p]) for p in on],
            [weights.bounds[p] for p in on], self.rows, self.valid, out, on)


@dataclass
class SiteSlots:
    """One site's slots: every slot's A, ``a`` [slots, in, parts * r] (part, then rank),
    and per part every slot's B, [slots, r, that part's width]; ``bounds``: each part's
    output columns."""

    a: torch.Tensor
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
                    torch.zeros(num_slots, k, len(widths) * max_rank, dtype=dtype,
                                device=dev),
                    [torch.zeros(num_slots, max_rank, w, dtype=dtype, device=dev)
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
        for w in self.weights.values():
            w.a[slot].zero_()
            for b, held in zip(w.bs, w.held, strict=True):
                b[slot].zero_()
                held.discard(slot)

    def _write(self, slot: int, adapter: Adapter) -> None:
        self._clear(slot)
        r = self.max_rank
        for key, w in self.weights.items():
            lora = adapter.sites.get(key)
            if lora is None:
                continue
            for part, (b_slots, ab) in enumerate(zip(w.bs, lora.parts, strict=True)):
                if ab is not None:
                    a, b = ab
                    w.a[slot, :, part * r:part * r + a.shape[1]].copy_(a)
                    b_slots[slot, :b.shape[0]].copy_(b)
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
        groups, rows, valid = group_rows([placed[n] if n is not None else -1
                                          for n in row_adapters])
        return LoraStep(self.slots, groups, rows.to(device),
                        valid.to(device, self.model.dtype))


def group_rows(row_slots: list[int], chunk: int = CHUNK
               ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Rows grouped by slot (-1: none): (each group's slot, ascending; rows [groups, m],
    each group's rows in order, padded with row 0; valid [groups, m, 1], 1 on the real
    ones). A slot is one group unless the largest has more than ``chunk`` rows (a
    prefill's); then each is cut in groups of m, the larger of ``chunk`` and the mean
    rows per slot, so the padding stays under the rows themselves plus ``chunk`` per
    slot."""
    index = torch.tensor(row_slots)
    which = (index >= 0).nonzero().view(-1)
    used, group = torch.unique(index[which], sorted=True, return_inverse=True)
    order = torch.argsort(group, stable=True)
    which, group = which[order], group[order]
    counts = torch.bincount(group, minlength=len(used))
    m = int(counts.max())
    if m > chunk:
        m = max(chunk, -(-len(which) // len(used)))
    pos = torch.arange(len(group)) - (torch.cumsum(counts, 0) - counts)[group]
    pieces = (counts + m - 1) // m  # each slot's groups
    first = torch.cumsum(pieces, 0) - pieces
    g = first[group] + pos // m
    rows = torch.zeros(int(pieces.sum()), m, dtype=torch.long)
    valid = torch.zeros(rows.shape[0], m, 1)
    rows[g, pos % m] = which
    valid[g, pos % m] = 1.0
    return used.repeat_interleave(pieces).tolist(), rows, valid
