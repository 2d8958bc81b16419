"""Quantized checkpoints: modelslim's W8A8 / W8A8_DYNAMIC / W4A8_DYNAMIC under
``--quantization ascend`` and DeepSeek's block FP8, written by ``pdmesh quantize`` and
by hand. The engine's logits agree with the same model computed in floats from the
dequantized weights; every scale is read (change one, the output changes); what pdmesh
does not load is refused, naming the format or the flag."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdmesh.shared.cli.quantize import quantize_checkpoint
from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.kernels import get_backend
from pdmesh.shared.kernels import reference as ref
from pdmesh.shared.kernels.quant import QuantExperts, QuantLinear, pack_int4, unpack_int4
from pdmesh.shared.models import quantization
from pdmesh.shared.models.loader import load_model

ARCHS = ["qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v4"]
SCHEMES = ["w8a8_dynamic", "w8a8", "w4a8_dynamic", "fp8_block"]
# least cosine of the engine's logits with the dequantized float model's: what
# quantizing activations costs (FP8 weights are dequantized at load on this backend)
COSINE = {"w8a8_dynamic": 0.999, "fp8_block": 0.999, "w4a8_dynamic": 0.995, "w8a8": 0.99}
PROMPTS = [list(range(5, 40)), list(range(300, 333)), [7, 9, 11, 13] * 6]
FIRST = SamplingParams(max_tokens=1, temperature=0.0)


def flag(scheme: str) -> str | None:
    return None if scheme == "fp8_block" else "ascend"


@pytest.fixture(scope="module")
def quantized(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    made = {}

    def get(arch: str, scheme: str, **kw):
        key = (arch, scheme, tuple(sorted(kw.items())))
        if key not in made:
            out = root / f"{arch}-{scheme}-{len(made)}"
            quantize_checkpoint(tiny_models[arch], out, scheme, **kw)
            made[key] = out
        return made[key]
    return get


def first_logits(llm: LLM) -> torch.Tensor:
    """The logits the engine samples the prompts' first tokens from, [len(PROMPTS), V]."""
    with llm.engine.runner.logits_kept() as kept:
        llm.generate(PROMPTS, FIRST)
    (logits,) = kept
    return logits


def dequantized(folder, q: str | None) -> LLM:
    """The same checkpoint computed in floats from its dequantized weights."""
    llm = LLM(str(folder), device="cpu", dtype="float32", quantization=q, block_size=16)
    _, model = load_model(folder, llm.engine.backend, torch.float32, llm.engine.model_config,
                          q, dequantize=True)
    llm.engine.model.w = model.w
    return llm


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).min())


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_agree_with_the_dequantized_model(quantized, tiny_models, arch, scheme,
                                                 record_property):
    folder = quantized(arch, scheme)
    llm = LLM(str(folder), device="cpu", dtype="float32", quantization=flag(scheme),
              block_size=16)
    weights = [w for layer in llm.engine.model.w.layers for part in (layer.attn, layer.mlp)
               for w in vars(part).values()]
    kinds = {type(w).__name__ for w in weights}
    assert "QuantLinear" in kinds and (arch == "qwen3" or "QuantExperts" in kinds)
    assert {w.scheme for w in weights if isinstance(w, QuantLinear | QuantExperts)} <= {
        scheme, "w8a8_dynamic"}  # (static W8A8's experts are dynamic)
    if scheme == "fp8_block":  # held dequantized: the cpu backend has no FP8 GEMM
        assert all(w.packed is None for w in weights if isinstance(w, QuantLinear))
    got = first_logits(llm)
    want = first_logits(dequantized(folder, flag(scheme)))
    assert cosine(got, want) >= COSINE[scheme], cosine(got, want)
    float_model = first_logits(LLM(str(tiny_models[arch]), device="cpu", dtype="float32",
                                   block_size=16))
    # reported, not asserted: how often the first greedy token is the float model's
    record_property("greedy_agreement_with_float",
                    f"{int((got.argmax(-1) == float_model.argmax(-1)).sum())}/{len(PROMPTS)}")
    record_property("cosine_with_float", round(cosine(got, float_model), 6))


def test_a_modelslim_checkpoint_needs_the_flag(quantized, tiny_models, caplog):
    folder = quantized("qwen3", "w8a8_dynamic")
    with pytest.raises(ValueError, match=r"modelslim checkpoint \(quant_model_description"
                                         r".json: model_quant_type W8A8_DYNAMIC.*start it "
                                         r"with --quantization ascend"):
        LLM(str(folder), device="cpu")
    with pytest.raises(ValueError, match=r"start it with --quantization ascend"):
        LLM(str(folder), device="cpu", quantization="fp8")
    LLM(str(folder), device="cpu", quantization="modelslim")  # SGLang's spelling
    plain = str(tiny_models["qwen3"])
    with caplog.at_level(logging.WARNING, logger="pdmesh.shared.models.quantization"):
        llm = LLM(plain, device="cpu", quantization="ascend")
    assert isinstance(llm.engine.model.w.layers[0].attn.qkv, torch.Tensor)
    assert "--quantization ascend: without effect" in caplog.text and "not quantized" in \
        caplog.text
    with pytest.raises(ValueError, match=r"quantization: .*not 'awq'"):
        LLM(plain, device="cpu", quantization="awq")


def edit(folder, change) -> None:
    (f,) = folder.glob("*.safetensors")
    weights = load_file(str(f))
    change(weights)
    save_file(weights, str(f), metadata={"format": "pt"})


def edit_description(folder, change) -> None:
    path = folder / "quant_model_description.json"
    d = json.loads(path.read_text())
    change(d)
    path.write_text(json.dumps(d))


# every tensor a scheme's math reads, for one projection of layer 1
SCALES = {"w8a8_dynamic": ["weight_scale", "weight_offset"],
          "w4a8_dynamic": ["weight_scale", "weight_offset"],
          "w8a8": ["input_scale", "input_offset", "quant_bias", "deq_scale"],
          "fp8_block": ["weight_scale_inv"]}


@pytest.mark.parametrize(("scheme", "tensor"),
                         [(s, t) for s, ts in SCALES.items() for t in ts])
def test_every_scale_is_read(quantized, tmp_path, scheme, tensor):
    src = quantized("qwen3", scheme)
    folder = tmp_path / "edited"
    shutil.copytree(src, folder)
    before = first_logits(LLM(str(folder), device="cpu", dtype="float32",
                              quantization=flag(scheme), block_size=16))
    name = f"model.layers.1.mlp.down_proj.{tensor}"

    def change(w):
        t = w[name]
        if tensor in ("input_offset", "quant_bias"):
            w[name] = t + torch.ones_like(t) * 7
        elif tensor == "weight_offset":
            w[name] = t + 3
        else:
            w[name] = t * 1.5
    edit(folder, change)
    after = first_logits(LLM(str(folder), device="cpu", dtype="float32",
                             quantization=flag(scheme), block_size=16))
    assert not torch.allclose(before, after, atol=1e-4), name


def test_mixed_precision_per_layer(quantized, tiny_models):
    """modelslim's DeepSeek W4A8 layout: experts W4A8_DYNAMIC, the rest W8A8_DYNAMIC, the
    first layer left in floats."""
    folder = quantized("deepseek_v3", "w8a8_dynamic", expert_scheme="w4a8_dynamic",
                       keep_float=(r"layers\.0\.",))
    d = json.loads((folder / "quant_model_description.json").read_text())
    assert d["model.layers.0.self_attn.o_proj.weight"] == "FLOAT"
    assert d["model.layers.1.self_attn.o_proj.weight"] == "W8A8_DYNAMIC"
    assert d["model.layers.1.mlp.experts.3.down_proj.weight"] == "W4A8_DYNAMIC"
    assert d["model.layers.1.mlp.shared_experts.down_proj.weight"] == "W8A8_DYNAMIC"
    llm = LLM(str(folder), device="cpu", dtype="float32", quantization="ascend",
              block_size=16)
    layers = llm.engine.model.w.layers
    assert isinstance(layers[0].attn.o, torch.Tensor)
    assert layers[1].attn.o.scheme == "w8a8_dynamic"
    assert isinstance(layers[1].mlp.w2, QuantExperts) and layers[1].mlp.w2.scheme == \
        "w4a8_dynamic"
    got = first_logits(llm)
    assert cosine(got, first_logits(dequantized(folder, "ascend"))) >= COSINE["w4a8_dynamic"]


def test_shards_of_mixed_precision_are_fused_as_floats(quantized, tmp_path):
    """q | k | v with k left in floats: the fused projection is computed in floats
    (vLLM-Ascend refuses such a checkpoint), and still agrees."""
    folder = quantized("qwen3", "w8a8_dynamic", keep_float=(r"layers\.2\.self_attn\.k_proj",))
    llm = LLM(str(folder), device="cpu", dtype="float32", quantization="ascend",
              block_size=16)
    layers = llm.engine.model.w.layers
    assert isinstance(layers[2].attn.qkv, torch.Tensor)
    assert isinstance(layers[1].attn.qkv, QuantLinear)
    assert cosine(first_logits(llm), first_logits(dequantized(folder, "ascend"))) >= 0.999


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update({"model.layers.0.mlp.down_proj.weight": "W4A16"}),
     r"model.layers.0.mlp.down_proj.weight is W4A16 in quant_model_description.json"),
    (lambda d: d.update({"group_size": 64}), r"group_size 64: per-group W4A8 is not loaded"),
    (lambda d: d.update({"fa_quant_type": "C8"}), r"sets fa_quant_type 'C8'"),
    (lambda d: d.update({"model.layers.0.mlp.down_proj.weight": "FLOAT"}),
     r"model.layers.0.mlp.down_proj.weight is stored as I8 but quant_model_description"
     r".json does not give it a quantized type"),
    (lambda d: d.update({"model.layers.9.mlp.down_proj.weight": "W8A8"}),
     r"lists model.layers.9.mlp.down_proj.weight \(W8A8\), which is not in the safetensors"),
])
def test_a_description_pdmesh_does_not_load_is_refused(quantized, tmp_path, change, message):
    folder = tmp_path / "m"
    shutil.copytree(quantized("qwen3", "w8a8_dynamic"), folder)
    edit_description(folder, change)
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), device="cpu", quantization="ascend")


def test_missing_or_malformed_scales_are_named(quantized, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(quantized("qwen3", "w8a8"), folder)
    edit(folder, lambda w: w.pop("model.layers.1.self_attn.k_proj.deq_scale"))
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.k_proj.deq_scale is "
                                         r"missing \(model.layers.1.self_attn.k_proj.weight "
                                         r"is W8A8\)"):
        LLM(str(folder), device="cpu", quantization="ascend")
    folder = tmp_path / "w4"
    shutil.copytree(quantized("qwen3", "w4a8_dynamic"), folder)
    name = "model.layers.0.mlp.up_proj.weight"
    edit(folder, lambda w: w.update({name: torch.full((w[name].shape[0] * 2,
                                                       w[name].shape[1]), 9, dtype=torch.int8)}))
    with pytest.raises(ValueError, match=rf"{name} is W4A8_DYNAMIC but holds values outside"):
        LLM(str(folder), device="cpu", quantization="ascend")


def test_fp8_needs_its_block_scales(quantized, tmp_path):
    folder = tmp_path / "fp8"
    shutil.copytree(quantized("deepseek_v3", "fp8_block"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    edit(folder, lambda w: w.update({name: w[name][:, :0]}))
    with pytest.raises(ValueError, match=r"o_proj.weight's block scale has shape"):
        LLM(str(folder), device="cpu")
    edit(folder, lambda w: w.pop(name))
    with pytest.raises(ValueError, match=r"o_proj.weight is FP8 without"):
        LLM(str(folder), device="cpu")
    with pytest.raises(ValueError, match=r"--quantization ascend reads modelslim checkpoints;"
                                         r" .* is DeepSeek's block FP8"):
        LLM(str(folder), device="cpu", quantization="ascend")


# -- the layouts, by hand (not through the writer) -----------------------------------------
def test_w4a8_nibbles_pack_two_output_rows_low_first():
    rows = torch.tensor([[-8, 7, 0], [5, -1, -3], [1, 2, 3], [-4, -5, -6]], dtype=torch.int8)
    packed = pack_int4(rows)
    # byte (r, k) holds row 2r in its low nibble and row 2r + 1 in its high one
    low, high = rows[0::2].long() & 0xF, rows[1::2].long() & 0xF
    assert packed.tolist() == (((high << 4) | low).to(torch.uint8).view(torch.int8)).tolist()
    assert torch.equal(unpack_int4(packed), rows)


def read(tensors: dict[str, torch.Tensor], scheme: str) -> quantization.QTensor:
    return quantization.read_quantized("p.weight", scheme, tensors.get, torch.device("cpu"))


@pytest.mark.parametrize("scheme", ["w8a8_dynamic", "w4a8_dynamic"])
def test_a_hand_built_dynamic_weight_computes_its_definition(scheme):
    g = torch.Generator().manual_seed(1)
    hi = 7 if scheme == "w4a8_dynamic" else 127
    q = torch.randint(-hi, hi + 1, (6, 16), generator=g, dtype=torch.int8)
    scale = torch.rand(6, 1, generator=g) / 50
    offset = torch.zeros(6, 1)
    offset[2] = 3.0
    stored = pack_int4(q) if scheme == "w4a8_dynamic" else q
    w = quantization.kernel(read({"p.weight": stored, "p.weight_scale": scale.bfloat16(),
                                  "p.weight_offset": offset}, scheme))
    assert isinstance(w, QuantLinear) and w.shape == (16, 6)
    x = torch.randn(3, 16, generator=g)
    # the float weight the integers stand for: (q - offset) * scale, per output row
    w_float = ((q.double() - offset.double()) * scale.bfloat16().double()).t()
    got = get_backend("cpu").linear(x, w)
    assert torch.allclose(got.double(), ref.quant_linear(x, w).double(), atol=1e-5)
    assert cosine(got.flatten(), (x.double() @ w_float).flatten()) >= 0.999


def test_a_hand_built_static_weight_computes_its_definition():
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (5, 8), generator=g, dtype=torch.int8)
    input_scale, input_offset = 0.02, -3
    deq = torch.rand(5, generator=g) / 100
    quant_bias = torch.randint(-500, 500, (5,), generator=g, dtype=torch.int32)
    w = quantization.kernel(read({
        "p.weight": q, "p.weight_scale": torch.ones(5, 1), "p.weight_offset": torch.zeros(5, 1),
        "p.input_scale": torch.tensor([input_scale]),
        "p.input_offset": torch.tensor([input_offset], dtype=torch.int8),
        "p.deq_scale": deq, "p.quant_bias": quant_bias}, "w8a8"))
    x = torch.randn(4, 8, generator=g)
    qx = torch.clamp(torch.round(x.double() / input_scale + input_offset), -128, 127)
    want = (qx @ q.double().t() + quant_bias.double()) * deq.double()
    assert torch.allclose(get_backend("cpu").linear(x, w).double(), want, atol=1e-4)
    # float16 models store deq_scale as float32 bits in an int64 (vLLM-Ascend's layout)
    bits = deq.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    w16 = quantization.kernel(read({
        "p.weight": q, "p.weight_scale": torch.ones(5, 1), "p.weight_offset": torch.zeros(5, 1),
        "p.input_scale": torch.tensor([input_scale]),
        "p.input_offset": torch.tensor([input_offset], dtype=torch.int8),
        "p.deq_scale": bits, "p.quant_bias": quant_bias}, "w8a8"))
    assert torch.equal(w16.deq_scale, w.deq_scale)


def test_static_shards_calibrated_apart_keep_their_input_scales():
    """q | k fused, each with its own input scale: x is quantized once per run."""
    g = torch.Generator().manual_seed(3)

    def shard(rows: int, s: float, o: int) -> quantization.QTensor:
        return read({"p.weight": torch.randint(-127, 128, (rows, 8), generator=g,
                                               dtype=torch.int8),
                     "p.weight_scale": torch.ones(rows, 1), "p.weight_offset": torch.zeros(rows, 1),
                     "p.input_scale": torch.tensor([s]),
                     "p.input_offset": torch.tensor([o], dtype=torch.int8),
                     "p.deq_scale": torch.rand(rows, generator=g),
                     "p.quant_bias": torch.zeros(rows, dtype=torch.int32)}, "w8a8")

    a, b = shard(3, 0.01, 0), shard(4, 0.05, 5)
    fused = quantization.kernel(quantization.cat([a, b], torch.float32))
    assert fused.bounds == (0, 3, 7) and fused.input_scale == pytest.approx((0.01, 0.05))
    x = torch.randn(2, 8, generator=g)
    be = get_backend("cpu")
    parts = torch.cat((be.linear(x, quantization.kernel(a)), be.linear(x, quantization.kernel(b))),
                      dim=1)
    assert torch.equal(be.linear(x, fused), parts)


def test_cli_writes_a_checkpoint_and_names_bad_schemes(tiny_models, tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, "-m", "pdmesh", "quantize", str(tiny_models["qwen3"]),
                        str(out), "--scheme", "w8a8_dynamic"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "28 w8a8_dynamic projections (serve it with --quantization ascend)" in r.stdout
    assert (out / "quant_model_description.json").exists()
    assert (out / "tokenizer.json").exists()
    r = subprocess.run([sys.executable, "-m", "pdmesh", "quantize", str(out),
                        str(tmp_path / "again"), "--scheme", "w8a8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "is quantized already" in r.stderr
    with pytest.raises(ValueError, match=r"out: .* holds safetensors already"):
        quantize_checkpoint(tiny_models["qwen3"], out, "w8a8_dynamic")
    with pytest.raises(ValueError, match=r"expert_scheme: static W8A8 experts"):
        quantize_checkpoint(tiny_models["qwen3_moe"], tmp_path / "x", "w8a8",
                            expert_scheme="w8a8")


def test_fp8_blocks_dequantize_with_their_own_scale():
    """DeepSeek's block FP8: weight [N, K] in F8_E4M3, one scale per 128 x 128 block
    (the edge blocks partial): each element is its stored value times its block's scale."""
    g = torch.Generator().manual_seed(4)
    n, k = 130, 260
    w = (torch.randn(n, k, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=g) + 0.5
    got = quantization.dequantize_fp8(w, scale, (128, 128), torch.float32, "w")
    for i, j in [(0, 0), (127, 127), (128, 0), (129, 259), (5, 200), (100, 128)]:
        assert float(got[i, j]) == pytest.approx(float(w[i, j].float()) * float(
            scale[i // 128, j // 128]))
    with pytest.raises(ValueError, match=r"w's block scale has shape \(2, 2\), expected "
                                         r"\(2, 3\)"):
        quantization.dequantize_fp8(w, scale[:, :2], (128, 128), torch.float32, "w")
