"""Which quantization a checkpoint carries, read from its own files, and its weights
read as the kernels take them.

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

What loads (``plan``):

    modelslim      under ``--quantization ascend`` (as vLLM-Ascend and SGLang need it):
                   W8A8 (static), W8A8_DYNAMIC, W4A8_DYNAMIC (per channel, int4 packed two
                   to a byte along the output dimension, or one per byte) and FLOAT, per
                   weight, so layers mix precisions; each weight's tensors as vLLM-Ascend's
                   quantization methods read them (``weight``, ``weight_scale``,
                   ``weight_offset``; W8A8: ``input_scale``, ``input_offset``,
                   ``quant_bias``, ``deq_scale``)
    fp8            DeepSeek's block FP8 (``quant_method: fp8``, ``weight_block_size``):
                   F8_E4M3 weights with ``weight_scale_inv`` (V3) or ``scale`` (V4) per
                   block, dequantized per block at load (and blocked again for a
                   backend's FP8 GEMM); auto-detected, as vLLM does

A projection weight of a quantized scheme is a ``QTensor`` in checkpoint layout (out x
in) until the loader has fused and transposed it (``rows``, ``cat``, ``stack``,
``kernel``), and then the kernels' ``QuantLinear`` / ``QuantExperts``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from pdmesh.shared.kernels.quant import (
    DYNAMIC,
    FP8_BLOCK,
    QuantExperts,
    QuantLinear,
    unpack_int4,
)

log = logging.getLogger(__name__)

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
        # (a bare ".scale" is one only beside its weight: DeepSeek-V4's hyper-connection
        # scales in transformers' layout, "attn_hc.scale", are parameters of their own)
        if name.endswith(SCALE_SUFFIXES) and (
                not name.endswith(".scale") or name.removesuffix("scale") + "weight" in dtypes):
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


def refusal(folder: str | Path, fmt: QuantFormat, needs_flag: bool = False) -> ValueError:
    """The start-up error for a quantized checkpoint pdmesh does not load (or not
    without ``fmt.flag``)."""
    if needs_flag:
        return ValueError(f"model: {folder} is a {fmt.name} checkpoint ({fmt.evidence}); "
                          f"start it with {fmt.flag}, as vLLM-Ascend serves it")
    return ValueError(f"model: {folder} is a {fmt.name} checkpoint ({fmt.evidence}); "
                      f"pdmesh loads modelslim (--quantization ascend) and DeepSeek's block "
                      f"FP8 checkpoints only, and refuses this one rather than read it as "
                      f"floats without its scales")


# -- what loads ---------------------------------------------------------------------------
MODELSLIM_TYPES = {"W8A8": "w8a8", "W8A8_DYNAMIC": "w8a8_dynamic",
                   "W4A8_DYNAMIC": "w4a8_dynamic"}
FLOAT = "FLOAT"
QUANTIZATION_FLAGS = ("ascend", "fp8")  # --quantization values that load something
# description keys that quantize something other than weights (the KV cache, the
# attention or the indexer), which pdmesh does not read
NOT_WEIGHTS = ("fa_quant_type", "indexer_quant_type", "kv_quant_type", "kv_cache_type")
INTEGER_DTYPES = ("I8", "U8", "I16", "I32", "I64", "U16", "U32", "U64", "BOOL")


@dataclass(frozen=True)
class QuantPlan:
    """How a checkpoint's weights are read: ``kind`` "modelslim" (``types``: weight name
    -> pdmesh's scheme, FLOAT ones absent) or "fp8" (``block``: the weight block)."""

    kind: str
    types: dict[str, str] = field(default_factory=dict)
    block: tuple[int, int] = (128, 128)

    def describe(self) -> str:
        if self.kind == "fp8":
            return f"DeepSeek FP8, {self.block[0]}x{self.block[1]} blocks"
        counts: dict[str, int] = {}
        for scheme in self.types.values():
            counts[scheme] = counts.get(scheme, 0) + 1
        return "modelslim " + ", ".join(f"{n} {k.upper()}" for k, n in sorted(counts.items()))


def plan(folder: str | Path, dtypes: dict[str, str], flag: str | None) -> QuantPlan | None:
    """The quantization to load ``folder`` with, None for plain floats; ValueError for a
    format pdmesh does not load or a flag that does not match the checkpoint.
    ``flag``: --quantization (None: auto, as vLLM detects a config's method)."""
    flag = "ascend" if flag == "modelslim" else flag  # SGLang's spelling
    if flag is not None and flag not in QUANTIZATION_FLAGS:
        raise ValueError(f"quantization: pdmesh loads --quantization ascend (modelslim) and "
                         f"fp8 (DeepSeek's block FP8, also detected without the flag), not "
                         f"{flag!r}")
    folder = Path(folder)
    fmt = detect(folder, dtypes)
    if fmt is None:
        if flag is not None:  # (vLLM-Ascend stops here; the seeds say to drop the flag)
            log.warning("--quantization %s: without effect, %s is not quantized (no %s, no "
                        "quantization_config); its weights load as floats", flag, folder,
                        DESCRIPTION)
        return None
    if fmt.name == "modelslim":
        if flag != "ascend":
            raise refusal(folder, fmt, needs_flag=True)
        return _modelslim_plan(folder, dtypes)
    if fmt.name == "fp8":
        if flag == "ascend":
            raise ValueError(f"quantization: --quantization ascend reads modelslim "
                             f"checkpoints; {folder} is DeepSeek's block FP8 ({fmt.evidence}), "
                             f"which loads without the flag (or with --quantization fp8)")
        return _fp8_plan(folder, dtypes)
    raise refusal(folder, fmt)


def _modelslim_plan(folder: Path, dtypes: dict[str, str]) -> QuantPlan:
    description = json.loads((folder / DESCRIPTION).read_text())
    for key in NOT_WEIGHTS:
        if description.get(key) not in (None, FLOAT):
            raise ValueError(f"model: {folder / DESCRIPTION} sets {key} "
                             f"{description[key]!r}; pdmesh quantizes weights only (its KV "
                             f"cache: --kv-cache-dtype) and refuses rather than ignore it")
    group = description.get("group_size", 0)
    if group:
        raise ValueError(f"model: {folder / DESCRIPTION} has group_size {group}: per-group "
                         f"W4A8 is not loaded (vLLM-Ascend refuses it too); quantize per "
                         f"channel")
    types = {}
    for name, kind in description.items():
        if not name.endswith(".weight") or kind == FLOAT:
            continue
        if kind not in MODELSLIM_TYPES:
            raise ValueError(f"model: {name} is {kind} in {DESCRIPTION}; pdmesh loads "
                             f"{', '.join(MODELSLIM_TYPES)} and FLOAT")
        if name not in dtypes:
            raise ValueError(f"model: {DESCRIPTION} lists {name} ({kind}), which is not in "
                             f"the safetensors")
        types[name] = MODELSLIM_TYPES[kind]
    for name, dtype in dtypes.items():
        if name.endswith(".weight") and dtype in INTEGER_DTYPES and name not in types:
            raise ValueError(f"model: {name} is stored as {dtype} but {DESCRIPTION} does not "
                             f"give it a quantized type")
    return QuantPlan("modelslim", types)


def _fp8_plan(folder: Path, dtypes: dict[str, str]) -> QuantPlan:
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    block = quant.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"model: {folder}/config.json quantization_config: fp8 without a "
                         f"weight_block_size [rows, columns] (per-tensor FP8 is not loaded)")
    if not any(d.startswith("F8_E4M3") or d.startswith("F8_E5M2") for d in dtypes.values()):
        raise ValueError(f"model: {folder}/config.json says fp8 (quantization_config) but no "
                         f"tensor is stored as FP8")
    fp4 = [n for n, d in dtypes.items() if d in ("I8", "U8") and n.endswith(".weight")]
    if fp4:
        raise ValueError(f"model: {fp4[0]} is stored as {dtypes[fp4[0]]} in an fp8 "
                         f"checkpoint (FP4 experts): not loaded")
    return QuantPlan("fp8", block=(block[0], block[1]))


# -- weights in checkpoint layout -----------------------------------------------------------
@dataclass
class QTensor:
    """One quantized weight (or several fused along the output dimension) as the
    checkpoint stores it, out x in: every field is per output row."""

    scheme: str
    names: tuple[str, ...]  # the checkpoint weights it came from
    q: torch.Tensor  # int8 [..., N, K] (int4 values unpacked; fp8_block: dequantized)
    scale: torch.Tensor  # float32 [..., N]: weight_scale
    offset: torch.Tensor | None  # float32 [..., N]: weight_offset (None: all zero)
    deq_scale: torch.Tensor | None = None  # w8a8: float32 [N]
    quant_bias: torch.Tensor | None = None  # w8a8: int32 [N]
    input_scale: torch.Tensor | None = None  # w8a8: float32 [N], each row's input's
    input_offset: torch.Tensor | None = None  # w8a8: float32 [N]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def __getitem__(self, rows: torch.Tensor) -> QTensor:
        """The output rows ``rows`` (a 1-D index), in that order."""
        return self._map(lambda t: t[rows])

    def _map(self, fn) -> QTensor:
        return replace(self, **{k: fn(v) for k, v in vars(self).items()
                                if isinstance(v, torch.Tensor)})

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.scheme == FP8_BLOCK:  # held dequantized already
            return self.q.to(dtype)
        w = self.q.float()
        if self.offset is not None:
            w = w - self.offset.unsqueeze(-1)
        return (w * self.scale.unsqueeze(-1)).to(dtype)


def slice_weight(w: torch.Tensor | QTensor, dim: int, rows: slice, name: str
                 ) -> torch.Tensor | QTensor:
    """A tensor-parallel rank's slice of a [out, in] weight: output rows (dim 0) with
    their per-row scales, or input columns (dim 1), the per-row scales whole. Static
    W8A8 is not split by its input: its quant_bias folds the whole input's zero point
    (ValueError naming the weight)."""
    if isinstance(w, torch.Tensor):
        return w[rows] if dim == 0 else w[:, rows]
    if dim == 0:
        return w._map(lambda t: t[rows].contiguous())
    if w.scheme == "w8a8":
        raise ValueError(f"tensor_parallel_size: {name} is static W8A8, whose quant_bias "
                         "folds its whole input: it cannot be split by columns")
    return replace(w, q=w.q[:, rows].contiguous())


def cat(parts: list[torch.Tensor | QTensor], dtype: torch.dtype) -> torch.Tensor | QTensor:
    """Weights fused along the output dimension (q | k | v, gate | up, ...). Parts of one
    scheme stay quantized; parts of mixed precision are fused as floats (dequantized),
    said once in the log, where vLLM-Ascend refuses them."""
    if not any(isinstance(p, QTensor) for p in parts):
        return torch.cat(parts, dim=0)  # type: ignore[arg-type]
    schemes = {p.scheme if isinstance(p, QTensor) else FLOAT for p in parts}
    if len(schemes) > 1:
        names = [n for p in parts if isinstance(p, QTensor) for n in p.names]
        log.info("quantization: %s fused with weights of other precisions (%s): computed "
                 "in float from the dequantized weights", ", ".join(names),
                 ", ".join(sorted(s.upper() for s in schemes)))
        return torch.cat([dense(p, dtype) for p in parts], dim=0)
    first: QTensor = parts[0]  # type: ignore[assignment]

    def joined(field_name: str) -> torch.Tensor | None:
        values = [getattr(p, field_name) for p in parts]
        if all(v is None for v in values):
            return None
        like = first.scale
        return torch.cat([v if v is not None else torch.zeros(p.shape[-2], dtype=like.dtype,
                                                              device=like.device)
                          for v, p in zip(values, parts, strict=True)], dim=-1)

    q = torch.cat([p.q for p in parts], dim=-2)  # type: ignore[union-attr]
    return replace(first, names=tuple(n for p in parts for n in p.names), q=q,  # type: ignore[union-attr]
                   **{k: joined(k) for k in ("scale", "offset", "deq_scale", "quant_bias",
                                            "input_scale", "input_offset")})


def stack(experts: list[torch.Tensor | QTensor], dtype: torch.dtype
          ) -> torch.Tensor | QTensor:
    """Experts stacked [E, N, K]; quantized when every expert is, of one dynamic scheme
    (static W8A8 experts are computed in float: no MoE kernel takes them)."""
    quantized = [isinstance(e, QTensor) for e in experts]
    if not any(quantized):
        return torch.stack(experts)  # type: ignore[arg-type]
    schemes = {e.scheme for e in experts if isinstance(e, QTensor)}
    if all(quantized) and len(schemes) == 1 and next(iter(schemes)) in (*DYNAMIC, FP8_BLOCK):
        first: QTensor = experts[0]  # type: ignore[assignment]
        offsets = [e.offset for e in experts]  # type: ignore[union-attr]
        offset = None if all(o is None for o in offsets) else torch.stack(
            [o if o is not None else torch.zeros_like(first.scale) for o in offsets])
        return QTensor(first.scheme, tuple(n for e in experts for n in e.names),  # type: ignore[union-attr]
                       torch.stack([e.q for e in experts]),  # type: ignore[union-attr]
                       torch.stack([e.scale for e in experts]), offset)  # type: ignore[union-attr]
    names = [n for e in experts if isinstance(e, QTensor) for n in e.names]
    log.info("quantization: experts %s ... (%s) are computed in float from the dequantized "
             "weights", names[0], ", ".join(sorted(s.upper() for s in schemes)))
    return torch.stack([dense(e, dtype) for e in experts])


def dense(w: torch.Tensor | QTensor, dtype: torch.dtype) -> torch.Tensor:
    """A float weight, dequantizing a quantized one (for what no int8 kernel computes:
    MLA's absorbed kv_b, DeepSeek-V4's grouped wo_a, routers, embeddings)."""
    return w.dequantize(dtype) if isinstance(w, QTensor) else w


def kernel(w: torch.Tensor | QTensor) -> torch.Tensor | QuantLinear | QuantExperts:
    """Checkpoint layout (out x in) -> the kernels' input-major weight."""
    if isinstance(w, torch.Tensor):
        return w.transpose(-1, -2).contiguous()
    if w.q.dim() == 3:
        return QuantExperts(w.scheme, w.q.transpose(1, 2).contiguous(), w.scale.contiguous(),
                            None if w.offset is None else w.offset.contiguous())
    if w.scheme in (*DYNAMIC, FP8_BLOCK):
        return QuantLinear(w.scheme, w.q.t().contiguous(), w.scale.contiguous(),
                           None if w.offset is None else w.offset.contiguous(), names=w.names)
    assert w.input_scale is not None and w.input_offset is not None
    # runs of columns whose input shares one scale and zero point
    pairs = torch.stack((w.input_scale, w.input_offset), dim=1).tolist()
    bounds = [0] + [i for i in range(1, len(pairs)) if pairs[i] != pairs[i - 1]] + [len(pairs)]
    return QuantLinear(w.scheme, w.q.t().contiguous(), w.scale.contiguous(),
                       deq_scale=w.deq_scale, quant_bias=w.quant_bias,
                       input_scale=tuple(pairs[a][0] for a in bounds[:-1]),
                       input_offset=tuple(pairs[a][1] for a in bounds[:-1]),
                       bounds=tuple(bounds), names=w.names)


def read_quantized(name: str, scheme: str, get, device: torch.device) -> QTensor:
    """The modelslim weight ``name`` of ``scheme`` and its tensors; ``get(name)`` reads a
    tensor as stored (None if absent)."""
    base = name.removesuffix("weight")

    def need(suffix: str) -> torch.Tensor:
        t = get(base + suffix)
        if t is None:
            raise ValueError(f"model: {base}{suffix} is missing ({name} is "
                             f"{scheme.upper()})")
        return t.to(device)

    q = need("weight")
    if q.dtype != torch.int8:
        raise ValueError(f"model: {name} is {scheme.upper()} but stored as {q.dtype}, "
                         f"not int8")
    scale = need("weight_scale").float().reshape(-1)
    rows = scale.shape[0]
    if scheme == "w4a8_dynamic":
        if get(base + "weight_scale_second") is not None:
            raise ValueError(f"model: {base}weight_scale_second: per-group W4A8 is not "
                             f"loaded (vLLM-Ascend refuses it too); quantize per channel")
        if q.shape[0] * 2 == rows:
            q = unpack_int4(q)
        if int(q.min()) < -8 or int(q.max()) > 7:
            raise ValueError(f"model: {name} is W4A8_DYNAMIC but holds values outside the "
                             f"int4 range [-8, 7]")
    if q.dim() != 2 or q.shape[0] != rows:
        raise ValueError(f"model: {name} has shape {tuple(q.shape)} but {base}weight_scale "
                         f"{rows} rows")
    offset = get(base + "weight_offset")
    offset = None if offset is None or not bool(offset.any()) else offset.to(
        device).float().reshape(-1)
    if scheme in DYNAMIC:
        return QTensor(scheme, (name,), q, scale, offset)
    input_scale = need("input_scale").float().reshape(-1)
    input_offset = need("input_offset").float().reshape(-1)
    if input_scale.numel() != 1 or input_offset.numel() != 1:
        raise ValueError(f"model: {base}input_scale / input_offset must be one value each "
                         f"(per-tensor static activations)")
    if float(input_scale) <= 0:
        raise ValueError(f"model: {base}input_scale must be positive, got "
                         f"{float(input_scale)}")
    deq = need("deq_scale")
    if deq.dtype == torch.int64:  # float16 models: float32 bits in an int64
        deq = (deq & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    quant_bias = need("quant_bias").reshape(-1)
    if quant_bias.dtype != torch.int32:
        raise ValueError(f"model: {base}quant_bias must be int32, got {quant_bias.dtype}")
    return QTensor(scheme, (name,), q, scale, offset, deq.float().reshape(-1), quant_bias,
                   input_scale.expand(rows).clone(), input_offset.expand(rows).clone())


def fp8_block(name: str, dense: torch.Tensor) -> QTensor:
    """A dequantized FP8 weight [N, K], marked as such: a backend with an FP8 GEMM
    computes it as FP8 blocks again (``KernelBackend.prepare``); others as floats."""
    return QTensor(FP8_BLOCK, (name,), dense,
                   torch.ones(dense.shape[0], dtype=torch.float32, device=dense.device), None)


def dequantize_fp8(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype, name: str) -> torch.Tensor:
    """F8_E4M3 [N, K] times its per-block scale [ceil(N / bn), ceil(K / bk)] (DeepSeek's
    ``weight_scale_inv``: the factor that turns the stored values back into weights)."""
    bn, bk = block
    n, k = w.shape
    expected = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape) != expected:
        raise ValueError(f"model: {name}'s block scale has shape {tuple(scale.shape)}, "
                         f"expected {expected} for {n}x{k} in {bn}x{bk} blocks")
    full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w.float() * full).to(dtype)
