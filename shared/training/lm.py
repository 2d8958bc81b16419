"""Train a tiny model's own weights on the local corpus (``make-tiny-model --train``).

A random model's next-token distributions are nearly flat, so its greedy continuations
are close to arbitrary: no draft head predicts them, and speculation measured on one
says little about a real model, whose text is predictable. A few hundred steps of
next-token prediction on the tokenizer's corpus (the standard library's sources) give
the tiny model some of that: it continues code as code, and a distilled MTP head
(``--train-mtp``, run after this) then agrees with it as a real one does.

Trained: every weight of the decoder but the MoE routers (their bias and hash tables),
by cross-entropy over windows of the corpus, through ``trainable.layer_forward`` (the
serving computation, differentiable). The MTP layers are left to ``training.mtp``.
Architectures served by ``CausalLM`` (llama, qwen3, qwen3_moe, deepseek_v3); DeepSeek-V4
is refused.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pdmesh.shared.engine.llm import LLM
from pdmesh.shared.models.corpus import corpus_files
from pdmesh.shared.models.tokenizer import Tokenizer
from pdmesh.shared.models.transformer import CausalLM, LayerWeights, ModelWeights
from pdmesh.shared.training.trainable import (
    Batch,
    attention_tensors,
    layer_checkpoint,
    layer_forward,
    leaf,
    mlp_tensors,
    scratch_cache,
    tie_qk_norm,
    trainable_attention,
    trainable_mlp,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LmTraining:
    steps: int = 300
    batch: int = 16  # windows per step
    window: int = 128  # tokens per window
    lr: float = 3e-3
    held_out: int = 16  # windows from the corpus's end, never trained on
    seed: int = 0


def train_model(folder: str | Path, settings: LmTraining | None = None,
                corpus: list[str] | None = None) -> tuple[float, float]:
    """Train the model in ``folder`` and write its weights back in place. Returns the
    held-out next-token loss in nats per token (before, after)."""
    t = settings or LmTraining()
    if t.steps < 1 or t.batch < 1 or t.window < 2 or t.held_out < 1:
        raise ValueError(f"train_model: steps, batch, held_out must be >= 1 and window >= 2, "
                         f"got {t}")
    folder = Path(folder)
    torch.manual_seed(t.seed)
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=16, seed=t.seed,
              enable_prefix_caching=False, num_kv_blocks=8)
    model = llm.engine.model
    if not isinstance(model, CausalLM):
        raise ValueError(f"train_model: {folder} is a {llm.engine.model_config.architecture} "
                         f"model; training covers llama, qwen3, qwen3_moe and deepseek_v3")
    tok = Tokenizer(folder)
    ids = [i for f in (corpus or corpus_files())
           for i in tok.encode(Path(f).read_text(errors="replace"))]
    need = (t.held_out + t.batch) * t.window
    if len(ids) < need:
        raise ValueError(f"train_model: the corpus has {len(ids)} tokens, fewer than the "
                         f"{need} one step and the held-out windows take")
    cut = len(ids) - t.held_out * t.window
    test = [ids[cut + k * t.window:cut + (k + 1) * t.window] for k in range(t.held_out)]
    rng = random.Random(t.seed)

    def windows() -> list[list[int]]:
        return [ids[at:at + t.window] for at in
                (rng.randrange(0, cut - t.window + 1) for _ in range(t.batch))]

    bs = llm.engine.runner.block_size
    width = -(-t.window // bs)
    scratch = [scratch_cache(c, t.batch * width) for c in llm.engine.runner.kv_caches]
    student = _trainable(model.w, model.config.tie_word_embeddings)
    heads = model.config.num_heads

    def loss_of(seqs: list[list[int]], grad: bool) -> torch.Tensor:
        b = Batch.of(seqs, bs, width)
        model.backend.prepare_attention(b.meta)
        with torch.set_grad_enabled(grad):
            x = student.embed.index_select(0, b.ids)
            for layer, cache in zip(student.layers, scratch, strict=True):
                x = layer_forward(model, layer, x, b.positions, cache, b.meta)
            h = model.backend.rms_norm(x, student.final_norm, model.config.rms_norm_eps)
            head = student.embed.t() if model.config.tie_word_embeddings else student.lm_head
            last = torch.from_numpy(b.starts[1:]).long() - 1
            rows = torch.ones(len(b.ids), dtype=torch.bool)
            rows[last] = False  # a window's last token has no next one in it
            logits = torch.mm(h[rows], head)
            return F.cross_entropy(logits, b.ids[torch.roll(rows, 1)])

    def held_out() -> float:
        groups = [test[k:k + t.batch] for k in range(0, len(test), t.batch)]
        return sum(loss_of(g, grad=False).item() * len(g) for g in groups) / len(test)

    before = held_out()
    params = _tensors(student, model.config.tie_word_embeddings)
    opt = torch.optim.Adam(params, lr=t.lr)
    warm = max(1, t.steps // 20)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
        1 + math.cos(math.pi * min(s, t.steps) / t.steps)))
    for step in range(t.steps):
        loss = loss_of(windows(), grad=True)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay.step()
        tie_qk_norm(student.layers, heads)
        if step % 50 == 0 or step == t.steps - 1:
            log.info("train step %d: loss %.3f", step, loss.item())
    after = held_out()
    _write_back(folder, model, student)
    return before, after


def _trainable(w: ModelWeights, tied: bool) -> ModelWeights:
    layers = [LayerWeights(input_norm=leaf(x.input_norm), post_attn_norm=leaf(x.post_attn_norm),
                           attn=trainable_attention(x.attn, leaf),
                           mlp=trainable_mlp(x.mlp, leaf)) for x in w.layers]
    return ModelWeights(embed=leaf(w.embed), layers=layers, final_norm=leaf(w.final_norm),
                        lm_head=w.lm_head if tied else leaf(w.lm_head), mtp=[])


def _tensors(w: ModelWeights, tied: bool) -> list[torch.Tensor]:
    out = [w.embed, w.final_norm, *([] if tied else [w.lm_head])]
    for layer in w.layers:
        out += [layer.input_norm, layer.post_attn_norm, *attention_tensors(layer.attn),
                *mlp_tensors(layer.mlp)]
    return out


def _write_back(folder: Path, model: CausalLM, student: ModelWeights) -> None:
    path = folder / "model.safetensors"
    stored = load_file(str(path))
    dtype = stored["model.embed_tokens.weight"].dtype
    trained = {"model.embed_tokens.weight": student.embed.detach(),
               "model.norm.weight": student.final_norm.detach()}
    if "lm_head.weight" in stored and not model.config.tie_word_embeddings:
        trained["lm_head.weight"] = student.lm_head.detach().t()
    for i, layer in enumerate(student.layers):
        trained.update(layer_checkpoint(model, layer, stored, f"model.layers.{i}."))
    for key, x in trained.items():
        if key not in stored or stored[key].shape != x.shape:
            raise ValueError(f"train_model: {key} would not go back into {path} "
                             f"(trained {tuple(x.shape)})")
        stored[key] = x.contiguous().to(dtype)
    save_file(stored, str(path), metadata={"format": "pt"})
