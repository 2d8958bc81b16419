"""A CPU stand-in for a device graph (``torch.cuda.CUDAGraph`` / ``torch.npu.NPUGraph``),
with their contract rather than their speed:

- capturing runs nothing: each aten op is recorded with the very tensors it was given,
  and its results are fresh tensors of the right shape holding garbage (NaN, or a large
  integer), as a device graph's pool memory holds before its first replay; an op that
  writes into its arguments writes nothing;
- a host read of a value while capturing (``.item()``, ``.tolist()``, ``bool(t)``,
  ``.numpy()``, an op whose result's shape depends on values) is refused, as a capturing
  stream refuses a synchronisation;
- a replay runs the recorded ops again on the same tensors, each result copied into the
  tensor the capture handed out (its "address"), so whatever the capture froze (a Python
  number, a shape) stays frozen, and whatever lives in a tensor is read afresh;
- a collective (c10d's ops: tensor parallelism's all-reduces and gathers) is captured
  like any op and runs at each replay, as NCCL's and HCCL's run inside a graph.

Views are taken for real (they compute nothing; a later write through one must land);
an op that may return a view but returned a copy (``aten.to``) is recorded as computing.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from pdmesh.shared.engine.decode_graphs import GraphDevice

GARBAGE_INT = -(2**40) + 3


class CaptureError(RuntimeError):
    """What a capturing device stream raises on a synchronisation."""


def _refuse(what: str):
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise CaptureError(f"{what} while capturing: a host read of a device value")
    return refused


_HOST_READS = ("tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__")


class _Recording(TorchDispatchMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.namespace == "c10d":  # a collective: captured, run by the replays
            self.ops.append((func, args, kwargs, None))
            # (its outputs: the tensors it was given to write; its Work: complete)
            out = tuple(_done() if "Work" in str(r.type) else args[0]
                        for r in func._schema.returns)
            return out[0] if len(out) == 1 else out
        if name in ("_local_scalar_dense", "nonzero", "equal", "is_nonzero"):
            raise CaptureError(f"aten.{name} while capturing: a host read of a device value")
        schema = func._schema
        aliases = [r.alias_info for r in schema.returns]
        if schema.is_mutable:  # writes into an argument: nothing runs yet
            self.ops.append((func, args, kwargs, None))
            written = [args[i] if i < len(args) else kwargs.get(arg.name)
                       for i, arg in enumerate(schema.arguments)
                       if arg.alias_info is not None and arg.alias_info.is_write]
            written = [w for w in written if w is not None]
            if len(schema.returns) == 1 and written:
                return written[0]
            return tuple(written) if written else None
        if aliases and all(a is not None for a in aliases):  # maybe a view
            out = func(*args, **kwargs)
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
            if all(t.untyped_storage().data_ptr() in inputs for t in tree_flatten(out)[0]
                   if isinstance(t, torch.Tensor)):
                return out  # a view: taken for real
            out = tree_map(_garbage, out)  # (aten.to and the like: a copy after all)
            self.ops.append((func, args, kwargs, out))
            return out
        meta_args, meta_kwargs = tree_map(_to_meta, (args, kwargs))
        try:
            shaped = func(*meta_args, **meta_kwargs)
        except (NotImplementedError, RuntimeError) as exc:
            raise CaptureError(f"aten.{name} while capturing: its result's shape is "
                               f"unknown before it runs ({exc})") from None
        out = tree_map(_garbage, shaped)
        self.ops.append((func, args, kwargs, out))
        return out


def _done() -> Any:
    """A collective's Work, already complete (what waiting on a captured one costs)."""
    from torch._C._distributed_c10d import _create_work_from_future

    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(None)
    return _create_work_from_future(fut).boxed()  # (the dispatcher takes it boxed)


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _garbage(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    t = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(GARBAGE_INT if t.dtype == torch.int64 else -7)


class RecordedGraph:
    """The stand-in graph: ``capture_begin`` / ``capture_end`` / ``replay``."""

    live: list[RecordedGraph] = []  # every graph whose capture has not ended

    def __init__(self) -> None:
        self.ops: list = []
        self._mode: _Recording | None = None
        self._saved: dict[str, Any] = {}
        self.replays = 0

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise ValueError(f"capture_error_mode: {capture_error_mode!r}")
        if RecordedGraph.live:
            raise CaptureError("capture_begin inside another capture")
        self._mode = _Recording(self.ops)
        self._mode.__enter__()
        for name in _HOST_READS:
            self._saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, _refuse(f"Tensor.{name}"))
        RecordedGraph.live.append(self)

    def capture_end(self) -> None:
        assert self._mode is not None
        for name, fn in self._saved.items():
            if fn is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, fn)
        self._mode.__exit__(None, None, None)
        self._mode = None
        RecordedGraph.live.remove(self)

    def replay(self) -> None:
        if self._mode is not None:
            raise CaptureError("replay of a graph still capturing")
        self.replays += 1
        with torch.inference_mode():
            for func, args, kwargs, out in self.ops:
                result = func(*args, **kwargs)
                if func.namespace == "c10d":
                    (result[-1] if isinstance(result, tuple) else result).wait()
                if out is None:
                    continue
                for dst, src in zip(tree_flatten(out)[0], tree_flatten(result)[0],
                                    strict=True):
                    if isinstance(dst, torch.Tensor):
                        dst.copy_(src)


def standin_device() -> GraphDevice:
    """A GraphDevice over the stand-in graph (the cpu has no stream to capture on)."""
    return GraphDevice(RecordedGraph, pool=None, capture_stream=nullcontext)


def standin_tp_worker(config, rank, top, messages) -> None:
    """A tensor-parallel worker process with the npu backend over its torch_npu stand-in
    and this graph stand-in (what rank 0 of the test runs with), then the real one."""
    import pdmesh.shared.engine.decode_graphs as decode_graphs
    import pdmesh.shared.engine.tp_worker as tp_worker
    from tests.shared.kernels.npu_standin import npu_backend

    backend = npu_backend()
    tp_worker.get_backend = lambda device: backend
    decode_graphs.GraphDevice.of = staticmethod(lambda device: standin_device())
    tp_worker.tensor_parallel_worker(config, rank, top, messages)


def standin_ep_rank(rank: int, world: int, address: str, model: str,
                    shares: list[list[list[int]]], graphs: bool, fine: dict | None = None,
                    ep: bool = True, max_tokens: tuple[int, ...] = (8, 8)) -> tuple:
    """One DP rank (gloo) stepped in lockstep with the others - expert parallelism
    (``ep``), fine-grained TP (``fine``: finegrained_tp_config) - with the npu backend over
    its torch_npu stand-in and this graph stand-in, over its share of the prompts
    (``max_tokens[rank]`` greedy tokens each, bfloat16), its expert load recorded for
    EPLB: (its tokens, replays, why graphs were turned off, the load per MoE layer and
    expert, or None without expert parallelism)."""
    import torch.distributed as dist

    import pdmesh.shared.engine.build as engine_build
    import pdmesh.shared.engine.decode_graphs as decode_graphs
    from pdmesh.shared.engine import SamplingParams
    from pdmesh.shared.engine.config import EngineConfig
    from pdmesh.shared.parallel.ranks import lockstep
    from tests.shared.kernels.npu_standin import npu_backend

    torch.set_num_threads(1)
    backend = npu_backend()
    engine_build.get_backend = lambda device: backend
    decode_graphs.GraphDevice.of = staticmethod(lambda device: standin_device())
    eng = engine_build.build_engine(EngineConfig(
        model=model, device="cpu", dtype="bfloat16", block_size=16,
        data_parallel_size=world, data_parallel_rank=rank, data_parallel_address=address,
        enable_expert_parallel=ep, enforce_eager=not graphs, expert_load_window=64,
        finegrained_tp_config=fine,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4]}))
    ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens[rank],
                                             ignore_eos=True)).request_id
           for p in shares[rank]]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    for _ in lockstep(eng):
        for o in eng.step():
            tokens[o.request.request_id] += o.new_token_ids
    g = eng.runner.graphs
    recorder = getattr(eng.model, "load_recorder", None)
    load = None if recorder is None else recorder.load().tolist()
    dist.destroy_process_group()
    return ([tokens[r] for r in ids], 0 if g is None else g.replays,
            None if g is None else g.disabled, load)
