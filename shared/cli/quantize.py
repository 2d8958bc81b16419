"""`pdmesh quantize MODEL OUT --scheme ...`: a quantized copy of a float checkpoint, in
the layouts pdmesh loads (and vLLM-Ascend / vLLM read):

    w8a8_dynamic   modelslim: int8 weight, weight_scale / weight_offset [out, 1]
    w8a8           modelslim static: also input_scale / input_offset (per tensor,
                   calibrated on prompts: the min and max each projection's input takes),
                   deq_scale = input_scale * weight_scale and quant_bias (the zero point
                   and any bias folded into int32); experts stay W8A8_DYNAMIC, as
                   modelslim's W8A8 MoE checkpoints have them (no MoE kernel is static)
    w4a8_dynamic   modelslim: int4 per channel, two to a byte along the output dimension
                   (even row in the low nibble), weight_scale / weight_offset, and the
                   scale_bias vLLM-Ascend's NPU kernel takes (8 * scale * row sum)
    fp8_block      DeepSeek's: F8_E4M3 weights, one float32 scale per 128 x 128 block
                   (``weight_scale_inv``; DeepSeek-V4 names it ``scale``) and the config's
                   quantization_config

modelslim checkpoints get ``quant_model_description.json`` naming every tensor's type
(serve them with ``--quantization ascend``). Every projection is quantized except the
embeddings, the LM heads, the MoE routers and the two that no int8 kernel computes
(DeepSeek's absorbed kv_b_proj and DeepSeek-V4's grouped wo_a), and those matching
``--keep-float``. Works for every architecture the engine serves: it reads tensors by
name, and the static scheme's calibration runs the model through the engine (so this
sits with the commands, above the engine; ``models.quantization`` reads what it writes).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdmesh.shared.engine.llm import LLM
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.kernels.quant import pack_int4, quantize_fp8_blocks, quantize_weight
from pdmesh.shared.models.checkpoint import open_checkpoint
from pdmesh.shared.models.config import ModelConfig
from pdmesh.shared.models.corpus import corpus_files
from pdmesh.shared.models.quantization import DESCRIPTION, detect

SCHEMES = ("w8a8_dynamic", "w8a8", "w4a8_dynamic", "fp8_block")
MODELSLIM_NAME = {"w8a8_dynamic": "W8A8_DYNAMIC", "w8a8": "W8A8",
                  "w4a8_dynamic": "W4A8_DYNAMIC"}
# what stays in floats: embeddings, heads, routers, and what no int8 kernel computes
KEEP_FLOAT = (r"embed_tokens\.", r"(^|\.)embed\.weight$", r"emb\.tok_emb\.", r"lm_head\.",
              r"(^|\.)head\.weight$", r"shared_head\.head\.", r"mlp\.gate\.weight$",
              r"ffn\.gate\.weight$", r"kv_b_proj\.", r"attn\.wo_a\.")
EXPERT = re.compile(r"\.experts\.\d+\.")
FP8_BLOCK = (128, 128)
CALIBRATION_PROMPTS = 16
CALIBRATION_TOKENS = 256


def quantize_checkpoint(src: str | Path, out: str | Path, scheme: str,
                        expert_scheme: str | None = None, keep_float: tuple[str, ...] = (),
                        calibration: list[str] | None = None) -> dict[str, str]:
    """Write ``src`` quantized with ``scheme`` to ``out``; returns each projection
    weight's type. ``expert_scheme``: MoE experts' (default: the scheme's; static w8a8:
    w8a8_dynamic); ``keep_float``: regexes of weight names left in floats;
    ``calibration``: the static scheme's prompts (default: text of the local corpus)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if scheme == "fp8_block" and expert_scheme not in (None, "fp8_block"):
        raise ValueError("expert_scheme: fp8_block checkpoints quantize experts as FP8 too")
    expert_scheme = expert_scheme or ("w8a8_dynamic" if scheme == "w8a8" else scheme)
    if expert_scheme not in SCHEMES or (expert_scheme == "fp8_block") != (scheme == "fp8_block"):
        raise ValueError(f"expert_scheme: one of w8a8_dynamic, w4a8_dynamic (w8a8 "
                         f"experts are dynamic), got {expert_scheme!r}")
    if expert_scheme == "w8a8":
        raise ValueError("expert_scheme: static W8A8 experts are not a modelslim scheme "
                         "(use w8a8_dynamic)")
    src, out = Path(src), Path(out)
    if out.exists() and any(out.glob("*.safetensors")):
        raise ValueError(f"out: {out} holds safetensors already; write to an empty folder "
                         f"(the engine would read both)")
    patterns = [re.compile(p) for p in (*KEEP_FLOAT, *keep_float)]
    with open_checkpoint(src) as ckpt:
        if detect(src, ckpt.dtypes()) is not None:
            raise ValueError(f"model: {src} is quantized already; quantize a float checkpoint")
        tensors = {name: ckpt.stored(name) for name in ckpt.names()}
    tensors = _split_stacked_experts(tensors)  # type: ignore[arg-type]
    kinds: dict[str, str] = {}
    for name, t in tensors.items():
        if (name.endswith(".weight") and t.dim() == 2 and t.dtype.is_floating_point
                and not any(p.search(name) for p in patterns)):
            kinds[name] = expert_scheme if EXPERT.search(name) else scheme
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != DESCRIPTION \
                and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    if scheme == "fp8_block":
        _write_fp8(tensors, kinds, src, out)
        return kinds
    stats = _calibrate(tensors, kinds, src, calibration) if scheme == "w8a8" else {}
    written: dict[str, torch.Tensor] = {}
    description: dict[str, str] = {"model_quant_type": MODELSLIM_NAME[scheme]}
    for name, t in tensors.items():
        kind = kinds.get(name)
        if kind is None:
            written[name] = t
            description[name] = "FLOAT"
            continue
        bias = tensors.get(name.removesuffix("weight") + "bias")
        for key, value in _modelslim_tensors(name, t, kind, stats.get(name), bias).items():
            written[key] = value
            description[key] = MODELSLIM_NAME[kind]
    save_file(written, str(out / f"quant_model_weight_{scheme}.safetensors"),
              metadata={"format": "pt"})
    (out / DESCRIPTION).write_text(json.dumps(description, indent=1) + "\n")
    return kinds


def _split_stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Experts stored stacked (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj``
    [E, H, I]) as the per-expert weights modelslim names."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{base}{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith(".experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e, w in enumerate(t):
                out[f"{base}{e}.down_proj.weight"] = w.contiguous()
        else:
            out[name] = t
    return out


def _modelslim_tensors(name: str, w: torch.Tensor, kind: str,
                       observed: tuple[float, float] | None, bias: torch.Tensor | None = None
                       ) -> dict[str, torch.Tensor]:
    base = name.removesuffix("weight")
    q, scale = quantize_weight(w, kind)
    dtype = w.dtype
    out = {name: q, base + "weight_scale": scale.to(dtype).unsqueeze(1),
           base + "weight_offset": torch.zeros(q.shape[0], 1, dtype=dtype)}
    if kind == "w4a8_dynamic":
        out[name] = pack_int4(q) if q.shape[0] % 2 == 0 else q
        out[base + "weight_scale"] = scale.unsqueeze(1)  # float32, as modelslim writes it
        out[base + "weight_offset"] = torch.zeros(q.shape[0], 1)
        out[base + "scale_bias"] = 8.0 * scale.unsqueeze(1) * q.float().sum(1, keepdim=True)
    elif kind == "w8a8":
        assert observed is not None, name
        lo, hi = min(observed[0], 0.0), max(observed[1], 0.0)
        in_scale = max(hi - lo, 1e-8) / 255.0
        in_offset = float(max(-128, min(127, round(-128 - lo / in_scale))))
        deq = scale.double() * in_scale
        out[base + "input_scale"] = torch.tensor([in_scale], dtype=dtype)
        out[base + "input_offset"] = torch.tensor([in_offset]).to(torch.int8)
        out[base + "deq_scale"] = deq.float()
        # x_q = x / s + o, so x_q . q = (x / s) . q + o * sum(q): the zero point's share
        # comes off in int32, and a float bias goes in as bias / deq (vLLM-Ascend's static
        # linear adds no float bias)
        folded = -in_offset * q.long().sum(1)
        if bias is not None:
            folded = folded + torch.round(bias.double() / deq).long()
        out[base + "quant_bias"] = folded.to(torch.int32)
    return out


def _calibrate(tensors: dict[str, torch.Tensor], kinds: dict[str, str], src: Path,
               prompts: list[str] | None) -> dict[str, tuple[float, float]]:
    """Each static projection's input range over the calibration prompts, observed by
    running a dynamic-int8 copy of the model through the engine (the projections keep
    their checkpoint names through fusion)."""
    stats: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="pdmesh-calibrate-") as tmp:
        dyn = {n: ("w8a8_dynamic" if k == "w8a8" else k) for n, k in kinds.items()}
        written: dict[str, torch.Tensor] = {}
        description = {"model_quant_type": "W8A8_DYNAMIC"}
        for name, t in tensors.items():
            if name in dyn:
                for key, value in _modelslim_tensors(name, t, dyn[name], None).items():
                    written[key] = value
                    description[key] = MODELSLIM_NAME[dyn[name]]
            else:
                written[name] = t
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != DESCRIPTION:
                shutil.copy2(f, Path(tmp) / f.name)
        save_file(written, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        (Path(tmp) / DESCRIPTION).write_text(json.dumps(description))
        # MTP layers see inputs only when the proposer runs
        mtp = ModelConfig.from_folder(src).num_nextn_predict_layers > 0
        llm = LLM(tmp, device="cpu", dtype="float32", quantization="ascend",
                  enable_prefix_caching=False, speculative_config={
                      "method": "deepseek_mtp", "num_speculative_tokens": 1} if mtp else None)
        backend = llm.engine.backend
        plain = backend.quant_linear

        def observe(x: torch.Tensor, w):
            if x.numel():
                lo, hi = float(x.min()), float(x.max())
                for name in w.names:
                    if kinds.get(name) == "w8a8":
                        a, b = stats.get(name, (lo, hi))
                        stats[name] = (min(a, lo), max(b, hi))
            return plain(x, w)

        backend.quant_linear = observe  # type: ignore[method-assign]
        texts = prompts or _corpus_prompts(llm)
        llm.generate([llm.tokenizer.encode(t)[:CALIBRATION_TOKENS] for t in texts if t.strip()],
                     SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        del llm
    missing = [n for n, k in kinds.items() if k == "w8a8" and n not in stats]
    if missing:
        raise ValueError(f"calibration: {missing[0]} saw no input (the prompts did not reach "
                         f"it)")
    return stats


def _corpus_prompts(llm) -> list[str]:
    """CALIBRATION_PROMPTS pieces of the local corpus, spread over its files."""
    files = corpus_files()
    step = max(1, len(files) // CALIBRATION_PROMPTS)
    out = []
    for f in files[::step][:CALIBRATION_PROMPTS]:
        text = Path(f).read_text(errors="replace")
        out.append(text[len(text) // 3:len(text) // 3 + 4 * CALIBRATION_TOKENS])
    return out


def _write_fp8(tensors: dict[str, torch.Tensor], kinds: dict[str, str], src: Path,
               out: Path) -> None:
    config = json.loads((src / "config.json").read_text())
    v4 = "DeepseekV4" in " ".join(config.get("architectures", []))
    written = {}
    for name, t in tensors.items():
        if name not in kinds:
            written[name] = t
            continue
        written[name], scale = quantize_fp8_blocks(t, FP8_BLOCK)
        written[name.removesuffix("weight") + ("scale" if v4 else "weight_scale_inv")] = scale
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "weight_block_size": list(FP8_BLOCK)}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a float checkpoint folder")
    p.add_argument("out", help="where the quantized checkpoint goes")
    p.add_argument("--scheme", choices=SCHEMES, required=True)
    p.add_argument("--expert-scheme", choices=("w8a8_dynamic", "w4a8_dynamic"), default=None,
                   help="MoE experts' scheme (default: --scheme's; w8a8: w8a8_dynamic)")
    p.add_argument("--keep-float", action="append", default=[], metavar="REGEX",
                   help="weights whose names match stay in floats (repeatable), e.g. "
                        "'layers\\.0\\.' for a float first layer")
    p.add_argument("--calibration-file", default=None,
                   help="w8a8: calibration prompts, one per line (default: local text)")


def run(a: argparse.Namespace) -> int:
    prompts = None
    if a.calibration_file:
        prompts = [ln for ln in Path(a.calibration_file).read_text().splitlines() if ln.strip()]
        if not prompts:
            raise SystemExit(f"--calibration-file: {a.calibration_file} has no prompts")
    try:
        kinds = quantize_checkpoint(a.model, a.out, a.scheme, a.expert_scheme,
                                    tuple(a.keep_float), prompts)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    counts: dict[str, int] = {}
    for kind in kinds.values():
        counts[kind] = counts.get(kind, 0) + 1
    flag = "" if a.scheme == "fp8_block" else " (serve it with --quantization ascend)"
    print(f"wrote {a.out}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
          + f" projections{flag}")
    return 0
