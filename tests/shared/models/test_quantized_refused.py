"""A quantized checkpoint is refused at start-up with its format named (modelslim's
description, a config's quantization_config, integer weights or scales with neither),
never loaded as floats without its scales."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdmesh.shared.engine import LLM


def copy(src, tmp_path, name: str):
    out = tmp_path / name
    shutil.copytree(src, out)
    return out


def rewrite(folder, change) -> None:
    weights = load_file(str(folder / "model.safetensors"))
    change(weights)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_a_modelslim_checkpoint_names_its_types_and_the_flag(tiny_models, tmp_path):
    folder = copy(tiny_models["qwen3"], tmp_path, "w8a8")
    kinds = {"model_quant_type": "W8A8_DYNAMIC",
             "model.layers.0.mlp.down_proj.weight": "W8A8_DYNAMIC",
             "model.layers.0.input_layernorm.weight": "FLOAT"}
    (folder / "quant_model_description.json").write_text(json.dumps(kinds))
    with pytest.raises(ValueError, match=r"modelslim checkpoint \(quant_model_description"
                                         r".json: model_quant_type W8A8_DYNAMIC, weight types "
                                         r"FLOAT, W8A8_DYNAMIC\).*--quantization ascend"):
        LLM(str(folder), device="cpu")
    (folder / "quant_model_description.json").write_text("{not json")
    with pytest.raises(ValueError, match="quant_model_description.json is not valid JSON"):
        LLM(str(folder), device="cpu")


def test_a_config_quantization_config_is_named(tiny_models, tmp_path):
    folder = copy(tiny_models["deepseek_v3"], tmp_path, "fp8")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "fmt": "e4m3", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json says fp8 \(quantization_config\) but "
                                         r"no tensor is stored as FP8"):
        LLM(str(folder), device="cpu")
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"awq checkpoint \(config.json quantization_config: "
                                         r"quant_method awq, bits 4\); pdmesh loads modelslim"):
        LLM(str(folder), device="cpu")


@pytest.mark.parametrize("arch,name", [("llama", "model.layers.1.mlp.up_proj.weight"),
                                       ("deepseek_v4", "layers.0.attn.wq_a.weight")])
def test_integer_weights_or_scales_alone_are_refused(tiny_models, tmp_path, arch, name):
    folder = copy(tiny_models[arch], tmp_path, f"int8-{arch}")
    rewrite(folder, lambda w: w.update({name: w[name].to(torch.int8)}))
    with pytest.raises(ValueError, match=rf"quantized tensors checkpoint \({name} is stored "
                                         rf"as I8\)"):
        LLM(str(folder), device="cpu")
    scale = name.removesuffix("weight") + ("scale" if arch == "deepseek_v4" else "weight_scale")
    rewrite(folder, lambda w: w.update({name: w[name].float(), scale: torch.ones(4)}))
    with pytest.raises(ValueError, match=rf"it has scale tensors \({scale}\)"):
        LLM(str(folder), device="cpu")
    rewrite(folder, lambda w: w.pop(scale))
    LLM(str(folder), device="cpu")  # floats again: it loads
