"""Distil a tiny model's MTP layer from the model itself (``make-tiny-model --train-mtp``).

Random weights make a draft head that agrees with the target almost never. This teaches
the MTP layer what the target does: the target continues prompts cut from the tokenizer's
corpus greedily; over those sequences, the MTP layer at position i (the target's hidden
state h_i, token i + 1) learns the target's next-token distribution at position i + 1
(KL divergence), exactly what it is asked to predict when drafting.

Trained: the whole MTP layer but its router (eh_proj, enorm, hnorm, the shared head,
the decoder layer's norms, MLA attention and experts). The forward is the serving
code's: ``CausalLM.mtp_input`` / ``mtp_logits`` and the attention kernels themselves
(differentiable over fresh sequences); the MLP in plain torch ops (the serving kernels
work in place), the same arithmetic, experts picked by the frozen router.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from pdmesh.shared.engine.llm import LLM
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.models.corpus import corpus_files
from pdmesh.shared.models.tokenizer import Tokenizer
from pdmesh.shared.models.transformer import LayerWeights, MLAWeights
from pdmesh.shared.training.trainable import (
    Batch,
    attention_tensors,
    layer_checkpoint,
    layer_forward,
    leaf,
    mlp_tensors,
    scratch_cache,
    trainable_attention,
    trainable_mlp,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class MtpTraining:
    prompts: int = 256
    prompt_tokens: int = 48
    new_tokens: int = 128
    random_sequences: int = 0  # of prompt_tokens random ids, the target's view only
    parts: str = "head"  # what is trained: "head" (eh_proj, norms, head), "attention"
    # too, or "all" (the experts too); more than the head overfits a random target
    chain: bool = True  # also train drafts 2.. (from the MTP layer's own output)
    steps: int = 300
    batch: int = 16  # sequences per step
    lr: float = 3e-3
    # below 1 the target's distribution is sharpened toward its argmax (what greedy
    # drafting must match); on a random target that overfits, so 1 by default
    teacher_temperature: float = 1.0
    seed: int = 0


def train_mtp(folder: str | Path, settings: MtpTraining | None = None,
              corpus: list[str] | None = None) -> tuple[float, float]:
    """Train the first MTP layer of the model in ``folder`` and write it back. Returns the
    held-out greedy agreement of the MTP head with the target (before, after)."""
    t = settings or MtpTraining()
    folder = Path(folder)
    torch.manual_seed(t.seed)
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=16, seed=t.seed,
              enable_prefix_caching=False)
    model = llm.engine.model
    if not getattr(model.w, "mtp", None):
        raise ValueError(f"train_mtp: {folder} has no MTP layer to train")
    layers = model.config.num_layers
    tok = Tokenizer(folder)
    rng = random.Random(t.seed)
    text = "".join(Path(f).read_text(errors="replace") for f in (corpus or corpus_files()))
    prompts = []  # half cut from the corpus, half random token ids (as benchmarks send)
    vocab = model.config.vocab_size
    while len(prompts) < t.prompts:
        if len(prompts) % 2:
            prompts.append([rng.randrange(vocab) for _ in range(t.prompt_tokens)])
            continue
        at = rng.randrange(0, max(1, len(text) - 8 * t.prompt_tokens))
        ids = tok.encode(text[at:at + 8 * t.prompt_tokens])[:t.prompt_tokens]
        if len(ids) >= 8:
            prompts.append(ids)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=t.new_tokens,
                                                ignore_eos=True))
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    held_out = max(1, len(seqs) // 8)
    # the target at every token of the vocabulary: random sequences, no continuation
    noise = [[rng.randrange(vocab) for _ in range(t.prompt_tokens)]
             for _ in range(t.random_sequences)]
    train, test = seqs[held_out:] + noise, seqs[:held_out]
    rng.shuffle(train)

    runner = llm.engine.runner
    bs = runner.block_size
    width = -(-max(map(len, train + test)) // bs)
    num_blocks = t.batch * width
    scratch = scratch_cache(runner.kv_caches[0], num_blocks)
    m = model.w.mtp[0]
    attn = m.layer.attn
    if not isinstance(attn, MLAWeights):
        raise ValueError(f"train_mtp: {folder}'s MTP layer is not MLA (DeepSeek-V3's)")

    trained = {name: leaf(getattr(m, name))
               for name in ("enorm", "hnorm", "eh_proj", "head_norm", "head")}
    layer = LayerWeights(input_norm=leaf(m.layer.input_norm),
                         post_attn_norm=leaf(m.layer.post_attn_norm),
                         attn=trainable_attention(attn, leaf), mlp=trainable_mlp(m.layer.mlp, leaf))
    student = dataclasses.replace(m, **trained, layer=layer)
    params = list(trained.values())
    if t.parts in ("attention", "all"):
        params += [*attention_tensors(layer.attn), layer.input_norm]
    if t.parts == "all":
        params += [layer.post_attn_norm, *mlp_tensors(layer.mlp)]
    params = [x for x in params if x is not None]

    def batch(group: list[list[int]]):
        """The target's hidden states and log-probabilities over ``group`` (one prefill
        through the engine's own cache), and the MTP layer's inputs and metadata."""
        target = Batch.of(group, bs, width)
        model.backend.prepare_attention(target.meta)
        hidden: list[torch.Tensor] = []
        logits = model.forward(target.ids, target.positions, runner.kv_caches, target.meta,
                               torch.arange(len(target.ids)), hidden)
        logp = torch.log_softmax(logits / t.teacher_temperature, dim=-1).clone()
        h = hidden[0].clone()
        # MTP rows: position i of each sequence but its last; target: the row after it
        qsl = target.starts
        keep = torch.from_numpy(np.concatenate([qsl[k] + np.arange(len(s) - 1)
                                                for k, s in enumerate(group)]))
        rows = Batch.of([s[:-1] for s in group], bs, width)
        return target.ids[keep + 1], rows.positions, h[keep], logp[keep + 1], rows.meta

    def student_logits(ids, pos, h, meta, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``CausalLM.mtp_block``'s computation, differentiable: (logits, output)."""
        model.backend.prepare_attention(meta)
        with torch.set_grad_enabled(grad):
            out = layer_forward(model, student.layer, model.mtp_input(student, ids, pos, h),
                                pos, scratch, meta)
            return model.mtp_logits(student, out), out

    def chained(pos, h, out) -> torch.Tensor:
        """The hidden states a chained draft continues from: at position i the MTP
        layer's own output at i - 1 (the target's where there is none)."""
        prev = torch.cat((out[:1], out[:-1]))
        return torch.where((pos == 0).unsqueeze(-1), h, prev)

    def kl(logp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return (logp.exp() * (logp - torch.log_softmax(logits, dim=-1))).sum(-1).mean()

    def agreement() -> float:
        hits = total = 0
        for k in range(0, len(test), t.batch):
            ids, pos, h, logp, meta = batch(test[k:k + t.batch])
            guess = student_logits(ids, pos, h, meta, grad=False)[0].argmax(-1)
            hits += int((guess == logp.argmax(-1)).sum())
            total += len(guess)
        return hits / max(1, total)

    before = agreement()
    prepared = [batch(train[k:k + t.batch]) for k in range(0, len(train), t.batch)]
    opt = torch.optim.Adam(params, lr=t.lr)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(opt, t.steps)
    for step in range(t.steps):
        ids, pos, h, logp, meta = prepared[step % len(prepared)]
        logits, out = student_logits(ids, pos, h, meta, grad=True)
        loss = kl(logp, logits)
        if t.chain:  # as drafts 2.. are proposed: from the layer's own output
            loss = loss + kl(logp, student_logits(ids, pos, chained(pos, h, out), meta,
                                                  grad=True)[0])
        opt.zero_grad()
        loss.backward()
        opt.step()
        decay.step()
        if step % 50 == 0 or step == t.steps - 1:
            log.info("train-mtp step %d: KL %.4f", step, loss.item())
    after = agreement()

    path = folder / "model.safetensors"
    weights = load_file(str(path))
    p = f"model.layers.{layers}."
    dtype = weights[p + "eh_proj.weight"].dtype
    for name, key, t_major in (("enorm", "enorm.weight", False),
                               ("hnorm", "hnorm.weight", False),
                               ("eh_proj", "eh_proj.weight", True),
                               ("head_norm", "shared_head.norm.weight", False),
                               ("head", "shared_head.head.weight", True)):
        w = trained[name].detach()
        weights[p + key] = (w.t() if t_major else w).contiguous().to(dtype)
    for key, w in layer_checkpoint(model, student.layer, weights, p).items():
        weights[key] = w.to(dtype)
    save_file(weights, str(path), metadata={"format": "pt"})
    return before, after
