"""Decode steps replayed from captured device graphs: vLLM's CUDA graphs on cuda,
vLLM-Ascend's ACL graphs (``torch.npu.NPUGraph``) on npu.

A uniform step - every sequence q tokens (1: decode; 1 + k: verifying k drafts), every
row's logits - of B sequences runs what was captured for (N, q), N the smallest capture
size >= B; rows past B x q are padding. The forward is captured in pieces, as vLLM's
PIECEWISE mode does: the ops that read the step's host-side plan - the KV cache writes,
attention, the routed experts (their group sizes) - run eagerly between the pieces, on
the step's real rows with its real attention metadata ("holes"); everything else
(embedding, norms, projections, rotary, gating, the lm_head) replays::

    capture, (N, q):  piece 0 | write  attend | piece 1 | write  attend | ... | piece L
    replay, B <= N:   ids, positions -> static buffers[:Bq]; piece 0; holes(q[:Bq], the
                      step's metadata) -> out[:Bq]; piece 1; ...; logits[:Bq]

A model whose attention reads a plan of its own (DeepSeek-V4) names it: ``graph_state(meta,
positions)`` builds the plan before the first piece (again from the step's metadata at
each replay), and ``graph_holes`` are its methods that run between the pieces (name ->
row arguments), as the backend's ``HOLES`` do.

A size is captured the first time a step pads to it (its warm-up forward, then the
capture, then one replay checked against the warm-up: a failure or a mismatch turns
graphs off with a warning, so a device whose graphs misbehave runs eagerly rather than
wrongly). Graphs are dropped when the KV cache tensors change (``invalidate`` for
anything else that replaces tensors a piece reads, such as weights).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pdmesh.shared.engine.graph_config import GraphConfig

log = logging.getLogger(__name__)

# The backend methods that run between the pieces -> their row arguments (cut to the
# step's rows at replay). The metadata and the slot mapping are the step's own.
HOLES: dict[str, tuple[str, ...]] = {
    "write_kv_cache": ("k", "v"),
    "write_cache": ("x",),
    "write_int8_cache": ("x",),
    "paged_attention_decode": ("q",),
    "latent_attention_decode": ("q",),
    "paged_attention_decode_int8": ("q",),
    "latent_attention_decode_int8": ("q",),
    "paged_attention_prefill": ("q", "k", "v"),
    "latent_attention_prefill": ("q", "entry"),
    "paged_attention_prefill_int8": ("q", "k", "v"),
    "latent_attention_prefill_int8": ("q", "entry"),
    "fused_moe": ("x", "topk_weights", "topk_ids"),
}
WRITES = frozenset({"write_kv_cache", "write_cache", "write_int8_cache"})
# Holes only a step's replay runs - a capture's warm-up and check leave them out - each
# with what stands in for its output there: expert parallelism's exchange (its
# collectives pair with the other DP ranks' steps: an extra forward would meet another
# rank's real step; zeros in its place) and the expert-load record (a capture's rows are
# no step's routing).
REPLAY_ONLY: dict[str, Callable[[inspect.BoundArguments], torch.Tensor | None]] = {
    "_ep_moe": lambda args: torch.zeros_like(args.arguments["x"]),
    "_record_load": lambda args: None,
}
# Holes that exchange rows with the other ranks: a lockstep rank with no rows (idle)
# still runs them at its replay; it skips the others (no rows to attend or route).
EXCHANGES = frozenset({"_ep_moe"})


class Graph(Protocol):
    """What a device's graph object offers (``torch.cuda.CUDAGraph``,
    ``torch.npu.NPUGraph``)."""

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None: ...
    def capture_end(self) -> None: ...
    def replay(self) -> None: ...


class Lockstep(Protocol):
    """Ranks that step together, their pieces exchanging rows (fine-grained TP's
    ``FineGrainedTP``)."""

    def agree_step(self, wish: int | None, per_seq: int, device: torch.device) -> int | None: ...
    def agree(self, ok: bool, device: torch.device) -> bool: ...
    def same_rows(self, rows: int) -> AbstractContextManager[None]: ...


@dataclass
class GraphDevice:
    """A device's graph API: a new graph, the memory pool the graphs share, a context
    that puts capture on a side stream, and a synchronize."""

    new_graph: Callable[[], Graph]
    pool: Any
    capture_stream: Callable[[], AbstractContextManager[Any]] = nullcontext
    synchronize: Callable[[], None] = lambda: None

    @classmethod
    def of(cls, device: torch.device) -> GraphDevice | None:
        """cuda: CUDA graphs; npu: torch_npu's NPUGraph (ACL graph); cpu: None (a CPU
        launches nothing to capture)."""
        if device.type == "cuda":
            api = torch.cuda
            new_graph = api.CUDAGraph
        elif device.type == "npu":
            import torch_npu  # noqa: F401  (torch.npu)

            api = torch.npu  # type: ignore[attr-defined]
            new_graph = api.NPUGraph
        else:
            return None
        stream = api.Stream(device=device)
        return cls(new_graph, api.graph_pool_handle(), lambda: api.stream(stream),
                   api.synchronize)


@dataclass
class _Hole:
    name: str
    args: inspect.BoundArguments
    rows: tuple[str, ...]
    out: torch.Tensor | None
    on_model: bool = False  # a model's method (``graph_holes``), not the backend's


@dataclass
class _Captured:
    """One capture size: its static inputs, its pieces and holes in order, its outputs."""

    size: int  # sequences
    per_seq: int  # tokens each (1; a verify step: 1 + its drafts)
    input_ids: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor  # the logits' rows: all of them
    meta: Any  # the capture's AttentionMetadata (the step's replaces it in the holes)
    steps: list[Graph | _Hole] = field(default_factory=list)
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    state: Any = None  # the model's step state for the capture (``graph_state``)


class _Capturing:
    """The backend as the model sees it while a size is warmed up or captured.

    Warming up (``captured`` None), a hole runs eagerly (a cache write not at all: the
    capture's rows are no step's) and its output's shape is noted. Capturing, a hole
    ends the current piece, takes an output of the noted shape (a piece's results do
    not exist before a replay: a hole cannot run on them) and begins the next piece."""

    def __init__(self, backend: Any, model: Any, device: GraphDevice,
                 shapes: list[tuple[torch.Size, torch.dtype] | None],
                 captured: _Captured | None = None):
        self._backend = backend
        self._model = model
        self._device = device
        self._shapes = shapes
        self._captured = captured
        self._piece: Graph | None = None
        self._holes = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._backend, name)
        if name in HOLES:
            return lambda *a, **kw: self._hole(name, attr, a, kw, HOLES[name])
        return attr

    def model_hole(self, name: str, rows: tuple[str, ...]) -> Callable:
        """The model's own method ``name`` as a hole (it reads the step's host plan)."""
        method = getattr(self._model, name)
        return lambda *a, **kw: self._hole(name, method, a, kw, rows, on_model=True)

    def begin(self) -> None:
        if self._captured is not None:
            self._piece = self._device.new_graph()
            # thread_local: the KV pool's transfer threads go on using the device while
            # a step is captured; only this thread's unsafe calls are errors
            self._piece.capture_begin(pool=self._device.pool,
                                      capture_error_mode="thread_local")

    def end(self) -> None:
        if self._piece is not None:
            self._piece.capture_end()
            assert self._captured is not None
            self._captured.steps.append(self._piece)
            self._piece = None

    def _hole(self, name: str, method: Callable, args: tuple, kwargs: dict,
              rows: tuple[str, ...], on_model: bool = False) -> Any:
        captured = self._captured
        if captured is None:  # warming up
            if name in WRITES:
                out = None
            elif name in REPLAY_ONLY:
                out = REPLAY_ONLY[name](inspect.signature(method).bind(*args, **kwargs))
            elif on_model:  # (the backend's own holes inside it run as they are)
                saved, self._model.backend = self._model.backend, self._backend
                try:
                    out = method(*args, **kwargs)
                finally:
                    self._model.backend = saved
            else:
                out = method(*args, **kwargs)
            self._shapes.append(None if out is None else (out.shape, out.dtype))
            return out
        self.end()
        bound = inspect.signature(method).bind(*args, **kwargs)
        slots = bound.arguments.get("slot_mapping")
        if slots is not None and slots is not captured.meta.slot_mapping:
            raise RuntimeError(f"{name} writes slots other than the step's slot mapping")
        if self._holes >= len(self._shapes):
            raise RuntimeError(f"{name}: more holes captured than warmed up")
        shape = self._shapes[self._holes]
        self._holes += 1
        out = None if shape is None else torch.zeros(shape[0], dtype=shape[1],
                                                     device=self._backend.device)
        captured.steps.append(_Hole(name, bound, rows, out, on_model))
        self.begin()
        return out


class DecodeGraphs:
    """The captured decode steps of one model runner: ``run`` a step from its graph, or
    None for a step they do not take."""

    def __init__(self, model: Any, backend: Any, kv_caches: list[Any], config: GraphConfig,
                 device: GraphDevice, meta_for: Callable[[int, int], Any],
                 max_per_seq: int = 1, agree: Callable[[bool], bool] | None = None,
                 lockstep: Lockstep | None = None):
        """``meta_for(n, q)``: the attention metadata of a capture: n sequences of q
        tokens at positions 0.., in the null block. ``max_per_seq``: the most tokens a
        sequence has in a step taken (1 + the drafts a verify step checks). ``agree``:
        tensor parallelism's "did every rank succeed" (each rank says its own), so the
        ranks keep or drop a capture together and never wait in each other's
        collectives. ``lockstep``: ranks whose pieces exchange rows with each other's
        (fine-grained TP): each step, they replay one size together or all run eagerly."""
        self.model = model
        self.lockstep = lockstep
        if lockstep is not None and agree is None:
            agree = lambda ok: lockstep.agree(ok, backend.device)  # noqa: E731
        self.agree = agree or (lambda ok: ok)
        self.max_per_seq = max_per_seq
        self.backend = backend
        self.kv_caches = kv_caches
        self.config = config
        self.device = device
        self._meta_for = meta_for
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._signature = self._kv_signature()
        self.disabled: str | None = None  # why graphs were turned off
        self.replays = 0
        self.captures = 0

    @property
    def sizes(self) -> list[tuple[int, int]]:
        """What was captured so far: (sequences, tokens each)."""
        return sorted(self._graphs)

    def invalidate(self) -> None:
        """Drop every captured size (each is captured again when next needed)."""
        self._graphs.clear()

    def _kv_signature(self) -> tuple:
        return tuple((t.data_ptr(), tuple(t.shape), t.dtype)
                     for cache in self.kv_caches for t in _tensors(cache))

    def size_for(self, seqs: int | None, per_seq: int) -> int | None:
        """The capture size a step of ``seqs`` sequences of ``per_seq`` tokens each
        replays (``seqs`` None: a step that is not uniform; 0: a lockstep rank's idle
        forward), or None: the step runs eagerly. Lockstep ranks agree on it, every rank
        at every forward."""
        wish = None
        if self.disabled is None and seqs is not None and per_seq <= self.max_per_seq:
            wish = 0 if seqs == 0 else self.config.size_for(seqs)
        if self.lockstep is not None:
            return self.lockstep.agree_step(wish, per_seq, self.backend.device)
        return wish or None

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
            hidden_out: list[torch.Tensor] | None, per_seq: int = 1,
            size: int | None = None) -> torch.Tensor | None:
        """The logits of every row of a uniform step - each sequence ``per_seq`` tokens
        (1: decode; 1 + k: verifying k drafts), its metadata prepared - from its graph
        (of ``size`` sequences: ``size_for``'s); None: run it eagerly. A lockstep rank's
        idle forward (no rows) replays too: its pieces' collectives meet the others'."""
        rows = int(input_ids.shape[0])
        per_seq = per_seq or 1
        if size is None:
            size = self.size_for(rows // per_seq, per_seq)
        if size is None or self.disabled is not None or not 1 <= per_seq <= self.max_per_seq:
            return None
        signature = self._kv_signature()
        if signature != self._signature:
            log.info("graphs: the KV cache tensors changed; sizes are captured again")
            self._graphs.clear()
            self._signature = signature
        captured = self._graphs.get((size, per_seq)) or self._capture(size, per_seq)
        if captured is None:
            return None
        captured.input_ids[:rows].copy_(input_ids)
        captured.positions[:rows].copy_(positions)
        if rows < size * per_seq:  # padding rows: token 0 at position 0
            captured.input_ids[rows:].zero_()
            captured.positions[rows:].zero_()
        try:
            state = (self.model.graph_state(meta, captured.positions[:rows])
                     if captured.state is not None else None)
            self._replay(captured, meta, rows, state=state)
        except Exception as exc:  # noqa: BLE001 (the step runs eagerly; said once)
            # (a hole's cache writes, if made, are made again: the same rows, the same slots)
            self.disabled = f"replaying {size} sequences x {per_seq} tokens failed: {exc}"
            log.warning("graphs: %s; decode runs eagerly", self.disabled)
            self._graphs.clear()
            return None
        assert captured.logits is not None and captured.hidden is not None
        self.replays += 1
        if hidden_out is not None:
            hidden_out.append(captured.hidden[:rows].clone())
        return captured.logits[:rows].clone()

    # -- capture ---------------------------------------------------------------------
    def _capture(self, size: int, per_seq: int) -> _Captured | None:
        dev = self.backend.device
        vocab = self.model.config.vocab_size
        rows = size * per_seq
        captured = _Captured(size, per_seq, (torch.arange(rows, device=dev) * 7919 + 17) % vocab,
                             torch.arange(per_seq, device=dev).repeat(size),
                             torch.arange(rows, device=dev), self._meta_for(size, per_seq))
        failed = None  # (tensor parallelism: every rank passes each stage, or none does)
        try:
            shapes: list[tuple[torch.Size, torch.dtype] | None] = []
            eager = None
            for _ in range(max(1, self.config.warmups)):  # (lazy initialisations)
                shapes.clear()
                eager = self._forward(captured, _Capturing(self.backend, self.model,
                                                           self.device, shapes))
            self.device.synchronize()
            with self.device.capture_stream():
                proxy = _Capturing(self.backend, self.model, self.device, shapes, captured)
                captured.logits = self._forward(captured, proxy)
            self.device.synchronize()
        except Exception as exc:  # noqa: BLE001 (any failure: eager from now on, said once)
            failed = exc
        if self.agree(failed is None) and failed is None:
            try:
                # checked against the warm-up (the null block unwritten, as there)
                self._replay(captured, captured.meta, rows, writes=False,
                             state=captured.state)
                self.device.synchronize()
                self._zero_null_block()  # (what a model's own holes wrote there)
                assert eager is not None and captured.logits is not None
                if not torch.allclose(captured.logits, eager, rtol=1e-2, atol=1e-2):
                    worst = (captured.logits - eager).abs().max().item()
                    raise RuntimeError(f"its replay differs from the eager forward by "
                                       f"{worst:.3g}")
            except Exception as exc:  # noqa: BLE001
                failed = exc
            if not self.agree(failed is None) and failed is None:
                failed = RuntimeError("another tensor-parallel rank's replay failed")
        elif failed is None:
            failed = RuntimeError("another tensor-parallel rank's capture failed")
        if failed is not None:
            self.disabled = (f"capturing steps of {size} sequences x {per_seq} tokens "
                             f"failed: {failed}")
            log.warning("graphs: %s; decode runs eagerly", self.disabled)
            self._graphs.clear()
            return None
        self._graphs[(size, per_seq)] = captured
        self.captures += 1
        log.info("graphs: captured steps of %d sequences x %d tokens (%d pieces)", size,
                 per_seq, sum(not isinstance(s, _Hole) for s in captured.steps))
        return captured

    def _forward(self, captured: _Captured, proxy: _Capturing) -> torch.Tensor:
        """The model over the capture's inputs, its backend ``proxy``, its own holes
        (``graph_holes``) through the proxy too, its step state (``graph_state``) built
        before the first piece."""
        self.backend.prepare_attention(captured.meta)
        model = self.model
        state = {}
        if hasattr(model, "graph_state"):
            captured.state = model.graph_state(captured.meta, captured.positions)
            state = {"step": captured.state}
        holes = getattr(model, "graph_holes", {})
        saved = model.backend
        model.backend = proxy
        for name, rows in holes.items():
            setattr(model, name, proxy.model_hole(name, rows))
        hidden: list[torch.Tensor] = []
        try:
            proxy.begin()
            same = (self.lockstep.same_rows(len(captured.rows)) if self.lockstep is not None
                    else nullcontext())
            try:
                with same:
                    logits = model.forward(captured.input_ids, captured.positions,
                                           self.kv_caches, captured.meta, captured.rows,
                                           hidden, **state)
            finally:
                proxy.end()
        finally:
            model.backend = saved
            for name in holes:
                delattr(model, name)  # (the class's own again)
        captured.hidden = hidden[0]
        return logits

    def _zero_null_block(self) -> None:
        """Block 0 of every cache tensor is the null block, kept zero."""
        for cache in self.kv_caches:
            for t in _tensors(cache):
                t[0].zero_()

    def _replay(self, captured: _Captured, meta: Any, b: int, writes: bool = True,
                state: Any = None) -> None:
        """Every piece and hole in turn, the holes on the first ``b`` rows with ``meta``
        (and the model's step ``state``) in place of the capture's."""
        for step in captured.steps:
            if not isinstance(step, _Hole):
                step.replay()
                continue
            if not writes and (step.name in WRITES or step.name in REPLAY_ONLY):
                continue
            if b == 0 and step.name not in EXCHANGES:  # (an idle lockstep rank)
                continue
            args = dict(step.args.arguments)
            for name in step.rows:
                args[name] = _cut(args[name], b)
            for name, value in args.items():
                if value is captured.meta:
                    args[name] = meta
                elif value is captured.state and state is not None:
                    args[name] = state
            if "slot_mapping" in args and not step.on_model:
                args["slot_mapping"] = meta.slot_mapping
            out = getattr(self.model if step.on_model else self.backend, step.name)(**args)
            if step.out is not None:
                step.out[:b].copy_(out)


def _cut(value: Any, b: int) -> Any:
    """A row argument's first ``b`` rows (its tensors', in a tuple or dict)."""
    if isinstance(value, torch.Tensor):
        return value[:b]
    if isinstance(value, dict):
        return {k: _cut(v, b) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_cut(v, b) for v in value)
    return value


def _tensors(cache: Any) -> list[torch.Tensor]:
    """The tensors of one layer's cache (a KVCache: its tensors by role)."""
    if isinstance(cache, torch.Tensor):
        return [cache]
    values = cache.values() if isinstance(cache, dict) else cache
    return [t for v in values for t in _tensors(v)]


def decode_graphs_for(config: Any, model: Any, runner: Any, backend: Any, *,
                      agree: Callable[[bool], bool] | None = None) -> DecodeGraphs | None:
    """An engine's decode graphs (``config``: its EngineConfig; every tensor-parallel
    rank builds its own, ``agree`` joining their verdicts), where its device captures
    and its model is captured; what runs eagerly instead is said at start-up."""
    graphs = config.graph_config()
    for warning in graphs.warnings:
        log.warning("engine: %s", warning)
    if not graphs.enabled:
        log.info("engine: decode graphs off (enforce_eager / cudagraph_mode NONE)")
        return None
    device = GraphDevice.of(backend.device)
    if device is None:
        log.info("engine: %s runs every step eagerly (a CPU launches no kernels to "
                 "capture)", backend.device.type)
        return None
    log.info("engine: decode steps of up to %d sequences from graphs (%d capture sizes, "
             "each captured when first needed)", graphs.sizes[-1], len(graphs.sizes))
    return DecodeGraphs(model, backend, runner.kv_caches, graphs, device,
                        runner.capture_metadata, agree=agree,
                        lockstep=getattr(model, "fg", None))
