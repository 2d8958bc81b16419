"""A model folder's safetensors as tensors: read lazily, by name, as stored or as the
loader asks for them (dequantized, or one tensor-parallel rank's slice), and the folder's
content fingerprint."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from pdmesh.shared.models import quantization
from pdmesh.shared.parallel.tensor_parallel import Shard


class CheckpointReader:
    """Tensor name -> tensor across every safetensors file of a folder, read lazily.

    With a quantization plan (``quant``), ``get`` of a quantized weight returns it as a
    ``quantization.QTensor`` (modelslim; FP8: dequantized per block, marked fp8_block);
    an integer or FP8 tensor asked for as a float that the plan does not cover is an
    error, never a cast."""

    def __init__(self, folder: Path, handles: dict[str, object]):
        self.folder = folder
        self._where = handles  # tensor name -> safe_open handle
        self.quant: quantization.QuantPlan | None = None
        self.dequantize = False  # quantized weights read as floats (a float reference)
        self.shard: Shard | None = None  # tensor parallelism: this rank's slices only
        self.q_heads = self.kv_heads = slice(None)  # (set with the shard)
        self.vocab = slice(None)
        # fine-grained TP (a FineGrainedLayout): the modules split over DP ranks
        self.fine = None

    def has(self, name: str) -> bool:
        return name in self._where

    def read_as(self, names: dict[str, tuple[str, tuple | None]]) -> None:
        """Read the tensors under other names from now on (``names``: new name -> (the
        stored name, what to take of it), models.v4_layout's)."""
        from pdmesh.shared.models.v4_layout import Renamed

        self._where = {new: Renamed(self._where[stored], stored, select)
                       for new, (stored, select) in names.items()}

    def names(self) -> list[str]:
        return list(self._where)

    def dtypes(self) -> dict[str, str]:
        """Tensor name -> its stored dtype ("F32", "BF16", "I8", "F8_E4M3", ...), from
        the headers alone."""
        return {name: h.get_slice(name).get_dtype()  # type: ignore[attr-defined]
                for name, h in self._where.items()}

    def stored(self, name: str) -> torch.Tensor | None:
        """A tensor as stored (its own dtype, on the CPU), None if absent."""
        if name not in self._where:
            return None
        return self._where[name].get_tensor(name)  # type: ignore[attr-defined]

    def get(self, name: str, dtype: torch.dtype, device: torch.device
            ) -> torch.Tensor | quantization.QTensor:
        if name not in self._where:
            raise ValueError(
                f"model: tensor {name!r} missing from the safetensors in {self.folder}")
        q = self.quant
        if q is not None and q.kind == "modelslim" and name in q.types:
            w = quantization.read_quantized(name, q.types[name], self.stored, device)
            return w.dequantize(dtype) if self.dequantize else w
        t = self._where[name].get_tensor(name)  # type: ignore[attr-defined]
        if dtype.is_floating_point and not t.dtype.is_floating_point:
            raise ValueError(f"model: {name} is stored as {t.dtype}, not as floats, and "
                             f"nothing says how it is quantized")
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and dtype != t.dtype:
            return self._fp8(name, t, dtype, device)
        return t.to(device=device, dtype=dtype)

    def _fp8(self, name: str, w: torch.Tensor, dtype: torch.dtype, device: torch.device
             ) -> torch.Tensor | quantization.QTensor:
        if self.quant is None or self.quant.kind != "fp8":
            raise ValueError(f"model: {name} is stored as {w.dtype} but the checkpoint has "
                             f"no fp8 quantization_config")
        base = name.removesuffix("weight")
        scale = self.stored(base + "weight_scale_inv")
        if scale is None:
            scale = self.stored(base + "scale")
        if scale is None:
            raise ValueError(f"model: {name} is FP8 without {base}weight_scale_inv "
                             f"(or {base}scale)")
        dense = quantization.dequantize_fp8(w.to(device), scale.to(device), self.quant.block,
                                            dtype, name)
        return dense if self.dequantize else quantization.fp8_block(name, dense)

    def part(self, name: str, dtype: torch.dtype, device: torch.device, dim: int,
             rows: slice) -> torch.Tensor | quantization.QTensor:
        """Only ``rows`` along ``dim`` of a weight (a tensor-parallel rank's slice): a
        float one read from the file as such; a quantized one (modelslim, FP8) read with
        its scales, one weight at a time, and sliced (its output rows with theirs; its
        input columns alone, its per-row scales whole)."""
        if rows == slice(None):
            return self.get(name, dtype, device)  # type: ignore[return-value]
        if name not in self._where:
            raise ValueError(
                f"model: tensor {name!r} missing from the safetensors in {self.folder}")
        if self.quant is not None and self._quantized(name):
            return quantization.slice_weight(self.get(name, dtype, device), dim, rows, name)
        view = self._where[name].get_slice(name)  # type: ignore[attr-defined]
        t = view[(slice(None),) * dim + (rows,)].to(device=device, dtype=dtype)
        # (a slice can come back as a view of more than itself: keep only its rows)
        return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t

    def _quantized(self, name: str) -> bool:
        q = self.quant
        assert q is not None
        if q.kind == "modelslim":
            return name in q.types
        stored = self._where[name].get_slice(name).get_dtype()  # type: ignore[attr-defined]
        return stored.startswith("F8")

    def shape(self, name: str) -> list[int]:
        if name not in self._where:
            raise ValueError(
                f"model: tensor {name!r} missing from the safetensors in {self.folder}")
        return self._where[name].get_slice(name).get_shape()  # type: ignore[attr-defined]

    def dense(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A weight as floats, dequantized if it is quantized (what no int8 kernel
        computes)."""
        return quantization.dense(self.get(name, dtype, device), dtype)

    def maybe(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        return self.dense(name, dtype, device) if name in self._where else None


@contextmanager
def open_checkpoint(folder: str | Path) -> Iterator[CheckpointReader]:
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors files in {folder}")
    with ExitStack() as stack:
        where: dict[str, object] = {}
        for f in files:
            handle = stack.enter_context(safe_open(str(f), framework="pt"))
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                where[name] = handle
        yield CheckpointReader(folder, where)


def model_fingerprint(folder: str | Path) -> str:
    """A content fingerprint of a model folder, the same wherever the folder lives.

    config.json whole, and per safetensors file its size, header (tensor names, shapes,
    offsets) and 64 KiB samples at 16 evenly spaced offsets: two checkpoints that share
    a layout but not weights differ in the samples. Milliseconds, even for large models.
    """
    folder = Path(folder)
    h = hashlib.blake2b(digest_size=16)
    h.update((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(header_len, size)))
            for i in range(16):
                fh.seek(size * i // 16)
                h.update(fh.read(1 << 16))
    return h.hexdigest()
