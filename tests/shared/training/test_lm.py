"""``make-tiny-model --train``: the model's own weights trained on the corpus. The
training forward is the engine's computation, the weights go back in the checkpoint's
layout (the engine, loading them, computes the loss the trainer reported), and the
held-out loss falls."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pdmesh.shared.engine import LLM
from pdmesh.shared.models.corpus import corpus_files
from pdmesh.shared.models.tokenizer import Tokenizer
from pdmesh.shared.training.lm import LmTraining, train_model
from pdmesh.shared.training.trainable import Batch, layer_checkpoint

SHORT = LmTraining(steps=12, batch=4, window=32, held_out=4, lr=3e-3)


def engine_loss(folder, windows: list[list[int]]) -> float:
    """The served model's mean next-token loss over ``windows`` (its own forward)."""
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=16,
              enable_prefix_caching=False)
    model, runner = llm.engine.model, llm.engine.runner
    total = 0.0
    for w in windows:
        b = Batch.of([w], runner.block_size, -(-len(w) // runner.block_size))
        model.backend.prepare_attention(b.meta)
        logits = model.forward(b.ids, b.positions, runner.kv_caches, b.meta,
                               torch.arange(len(w) - 1))
        total += F.cross_entropy(logits, b.ids[1:]).item()
    return total / len(windows)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_training_lowers_the_loss_the_engine_then_computes(tmp_path, tiny_models, arch):
    folder = tmp_path / arch
    shutil.copytree(tiny_models[arch], folder)
    corpus = corpus_files()[:3]
    before_weights = load_file(str(folder / "model.safetensors"))
    before, after = train_model(folder, SHORT, corpus=corpus)
    assert after < before - 0.5, (before, after)
    tok = Tokenizer(folder)
    ids = [i for f in corpus for i in tok.encode(open(f, errors="replace").read())]
    cut = len(ids) - SHORT.held_out * SHORT.window
    held = [ids[cut + k * SHORT.window:cut + (k + 1) * SHORT.window]
            for k in range(SHORT.held_out)]
    # the checkpoint written back is the one trained: the engine's loss is the trainer's
    assert engine_loss(folder, held) == pytest.approx(after, rel=1e-4)
    assert engine_loss(tiny_models[arch], held) == pytest.approx(before, rel=1e-4)
    written = load_file(str(folder / "model.safetensors"))
    assert set(written) == set(before_weights)
    changed = {k for k in written if not torch.equal(written[k], before_weights[k])}
    assert "model.embed_tokens.weight" in changed and "lm_head.weight" in changed
    assert any(".self_attn." in k for k in changed) and any(".mlp." in k for k in changed)
    # routers and the MTP layer are not this trainer's
    assert not any(k.endswith("mlp.gate.weight") or "e_score_correction_bias" in k
                   for k in changed)
    mtp = f"model.layers.{llm_layers(folder)}."
    assert not any(k.startswith(mtp) for k in changed)


def llm_layers(folder) -> int:
    import json
    return json.loads((folder / "config.json").read_text())["num_hidden_layers"]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_a_layer_read_and_written_back_is_the_checkpoints(tiny_models, arch):
    llm = LLM(str(tiny_models[arch]), device="cpu", dtype="float32", block_size=16)
    model = llm.engine.model
    stored = load_file(str(tiny_models[arch] / "model.safetensors"))
    for i, layer in enumerate(model.w.layers):
        p = f"model.layers.{i}."
        written = layer_checkpoint(model, layer, stored, p)
        ours = {k for k in stored if k.startswith(p) and not (
            k.endswith("mlp.gate.weight") or k.endswith("e_score_correction_bias"))}
        assert set(written) == ours, (arch, i)
        for key, x in written.items():
            assert torch.equal(x, stored[key]), (arch, key)


def test_refusals(tmp_path, tiny_models):
    with pytest.raises(ValueError, match="deepseek_v3"):
        train_model(tiny_models["deepseek_v4"], SHORT)
    with pytest.raises(ValueError, match="window"):
        train_model(tiny_models["qwen3"], LmTraining(window=1))
    for args, word in ((["--arch", "deepseek_v4", "--train"], "--train"),
                       (["--train-steps", "5"], "--train-steps")):
        run = subprocess.run([sys.executable, "-m", "pdmesh", "make-tiny-model",
                              str(tmp_path / "m"), *args], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode != 0 and word in run.stderr, run.stderr


def test_make_tiny_model_trains_from_the_command_line(tmp_path):
    out = tmp_path / "trained"
    run = subprocess.run([sys.executable, "-m", "pdmesh", "make-tiny-model", str(out),
                          "--arch", "llama", "--train", "--train-steps", "3"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    line = next(x for x in run.stdout.splitlines() if x.startswith("trained it on the corpus"))
    before, after = (float(v) for v in line.split("loss ")[1].split(" nats")[0].split(" -> "))
    assert after < before
