"""Distil a tiny model's MTP layer from the model itself (``make-tiny-model --train-mtp``).

Random weights make a draft head that agrees with the target almost never. This teaches
the MTP layer what the target does: the target continues prompts cut from the tokenizer's
corpus greedily; over those sequences, the MTP layer at position i (the target's hidden
state h_i, token i + 1) learns the target's next-token distribution at position i + 1
(KL divergence), exactly what it is asked to predict when drafting.

Trained: eh_proj, enorm, hnorm, the shared head (norm and projection) and the decoder
layer's attention (MLA: its projections, norms and up-projections); the layer's MLP (its
experts) keeps its weights. The forward is the serving code itself (the kernels, the
paged cache; attention over fresh sequences is differentiable there); the gradient
passes the MLP as it passes its residual connection (straight through).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from pdmesh.shared.engine.model_runner import attention_metadata
from pdmesh.shared.models.transformer import MLAWeights

log = logging.getLogger(__name__)


@dataclasses.dataclass
class MtpTraining:
    prompts: int = 128
    prompt_tokens: int = 48
    new_tokens: int = 96
    steps: int = 400
    batch: int = 16  # sequences per step
    lr: float = 3e-3
    # the target's distribution sharpened (< 1): what greedy drafting must match is its
    # argmax, which a random model's flat distributions hardly mark
    teacher_temperature: float = 0.1
    seed: int = 0


def train_mtp(folder: str | Path, settings: MtpTraining | None = None,
              corpus: list[str] | None = None) -> tuple[float, float]:
    """Train the first MTP layer of the model in ``folder`` and write it back. Returns the
    held-out greedy agreement of the MTP head with the target (before, after)."""
    from pdmesh.shared.engine import LLM, SamplingParams
    from pdmesh.shared.models.tiny import _corpus_files
    from pdmesh.shared.models.tokenizer import Tokenizer

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
    text = "".join(Path(f).read_text(errors="replace") for f in (corpus or _corpus_files()))
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
    train, test = seqs[held_out:], seqs[:held_out]

    runner = llm.engine.runner
    bs = runner.block_size
    width = -(-max(map(len, seqs)) // bs)
    num_blocks = t.batch * width
    scratch = {role: torch.zeros((num_blocks + 1, *x.shape[1:]), dtype=x.dtype)
               for role, x in runner.kv_caches[0].items()}
    m = model.w.mtp[0]
    attn = m.layer.attn
    if not isinstance(attn, MLAWeights):
        raise ValueError(f"train_mtp: {folder}'s MTP layer is not MLA (DeepSeek-V3's)")

    def leaf(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.detach().clone().requires_grad_()

    trained = {name: leaf(getattr(m, name))
               for name in ("enorm", "hnorm", "eh_proj", "head_norm", "head")}
    trained_attn = {name: leaf(getattr(attn, name)) for name in ATTENTION}
    input_norm = leaf(m.layer.input_norm)
    student = dataclasses.replace(m, **trained, layer=dataclasses.replace(
        m.layer, input_norm=input_norm, attn=dataclasses.replace(attn, **trained_attn)))
    params = [x for x in (*trained.values(), *trained_attn.values(), input_norm)
              if x is not None]

    def batch(group: list[list[int]]):
        """The target's hidden states and log-probabilities over ``group`` (one prefill
        through the engine's own cache), and the MTP layer's inputs and metadata."""
        n = [len(s) for s in group]
        table = np.arange(1, 1 + len(group) * width, dtype=np.int32).reshape(len(group), width)
        ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in group])
        pos = np.concatenate([np.arange(k, dtype=np.int64) for k in n])
        seq = np.repeat(np.arange(len(group)), n)
        slots = table[seq, pos // bs].astype(np.int64) * bs + pos % bs
        qsl = np.zeros(len(group) + 1, dtype=np.int32)
        np.cumsum(n, out=qsl[1:])
        meta = attention_metadata(torch.device("cpu"), table, [0] * len(group), n, n, pos,
                                  slots, qsl, bs)
        model.backend.prepare_attention(meta)
        hidden: list[torch.Tensor] = []
        logits = model.forward(torch.from_numpy(ids), torch.from_numpy(pos), runner.kv_caches,
                               meta, torch.arange(len(ids)), hidden)
        logp = torch.log_softmax(logits / t.teacher_temperature, dim=-1).clone()
        h = hidden[0].clone()
        # MTP rows: position i of each sequence but its last; target: the row after it
        keep = np.concatenate([qsl[k] + np.arange(c - 1) for k, c in enumerate(n)])
        m_n = [c - 1 for c in n]
        m_pos = np.concatenate([np.arange(c, dtype=np.int64) for c in m_n])
        m_seq = np.repeat(np.arange(len(group)), m_n)
        m_slots = table[m_seq, m_pos // bs].astype(np.int64) * bs + m_pos % bs
        m_qsl = np.zeros(len(group) + 1, dtype=np.int32)
        np.cumsum(m_n, out=m_qsl[1:])
        m_meta = attention_metadata(torch.device("cpu"), table, [0] * len(group), m_n, m_n,
                                    m_pos, m_slots, m_qsl, bs)
        rows = torch.from_numpy(keep)
        return (torch.from_numpy(ids[keep + 1]), torch.from_numpy(m_pos), h[rows],
                logp[rows + 1], m_meta)

    be, eps = model.backend, model.config.rms_norm_eps
    layer = student.layer

    def student_logits(ids, pos, h, meta, grad: bool) -> torch.Tensor:
        """``CausalLM.mtp_block``'s computation, the attention with its gradient."""
        model.backend.prepare_attention(meta)
        with torch.set_grad_enabled(grad):
            x = model.mtp_input(student, ids, pos, h)
            cache = {role: torch.zeros_like(c) for role, c in scratch.items()}
            a = model._attention(layer.attn, be.rms_norm(x, layer.input_norm, eps),
                                 model.cos.index_select(0, pos),
                                 model.sin.index_select(0, pos), cache, meta)
            r = x + a
        with torch.no_grad():
            mlp = model._mlp(layer.mlp, be.rms_norm(r.detach(), layer.post_attn_norm, eps),
                             None)
        with torch.set_grad_enabled(grad):
            return model.mtp_logits(student, r + mlp)

    def agreement() -> float:
        hits = total = 0
        for k in range(0, len(test), t.batch):
            ids, pos, h, logp, meta = batch(test[k:k + t.batch])
            guess = student_logits(ids, pos, h, meta, grad=False).argmax(-1)
            hits += int((guess == logp.argmax(-1)).sum())
            total += len(guess)
        return hits / max(1, total)

    before = agreement()
    prepared = [batch(train[k:k + t.batch]) for k in range(0, len(train), t.batch)]
    opt = torch.optim.Adam(params, lr=t.lr)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(opt, t.steps)
    for step in range(t.steps):
        ids, pos, h, logp, meta = prepared[step % len(prepared)]
        logits = student_logits(ids, pos, h, meta, grad=True)
        loss = (logp.exp() * (logp - torch.log_softmax(logits, dim=-1))).sum(-1).mean()
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
    weights[p + "input_layernorm.weight"] = input_norm.detach().to(dtype)
    for key, w in _mla_checkpoint(model.config, student.layer.attn).items():
        weights[p + "self_attn." + key] = w.to(dtype)
    save_file(weights, str(path), metadata={"format": "pt"})
    return before, after


# the MLA tensors trained (the loader's form; ``_mla_checkpoint`` writes them back)
ATTENTION = ("q", "q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "w_uk", "w_uv", "o")


def _mla_checkpoint(cfg, w: MLAWeights) -> dict[str, torch.Tensor]:
    """MLA weights in the loader's form back in the checkpoint's: [out, in], the rotary
    dims interleaved again where the checkpoint has them so, kv_b from W_UK and W_UV.
    (The inverse of ``loader._read_mla``.)"""
    m = cfg.mla
    h, nope, rope, lat = cfg.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    order = (torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
             if m.rope_interleave else torch.arange(rope))
    q_rows = torch.cat([torch.cat((torch.arange(nope), nope + order)) + j * (nope + rope)
                        for j in range(h)])
    kv_rows = torch.cat((torch.arange(lat), lat + order))

    def unpermute(loaded: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(loaded.t())
        out[rows] = loaded.detach().t()
        return out.contiguous()

    out = {"kv_a_proj_with_mqa.weight": unpermute(w.kv_a, kv_rows),
           "kv_a_layernorm.weight": w.kv_a_norm.detach().clone(),
           "kv_b_proj.weight": torch.cat((w.w_uk.detach(), w.w_uv.detach().transpose(1, 2)),
                                         dim=1).reshape(-1, lat).contiguous(),
           "o_proj.weight": w.o.detach().t().contiguous()}
    if w.q is not None:
        out["q_proj.weight"] = unpermute(w.q, q_rows)
    else:
        out["q_a_proj.weight"] = w.q_a.detach().t().contiguous()
        out["q_a_layernorm.weight"] = w.q_a_norm.detach().clone()
        out["q_b_proj.weight"] = unpermute(w.q_b, q_rows)
    return out
