"""`pdmesh make-tiny-model`: a randomly initialized model folder, made offline.

No model hub is reachable here, so tests and demos use these. The folder is an ordinary
Hugging Face checkpoint (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template, generation_config.json) and loads through
the same code as a real one. The tokenizer is a byte-level BPE trained on this
Python's standard-library sources; weights are drawn from a seeded generator, so the
same seed and size give the same files.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ARCHS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "qwen3_moe": "Qwen3MoeForCausalLM"}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS_BYTES = 4_000_000


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int
    experts_per_token: int
    expert_intermediate: int


SIZES = {
    "tiny": Shape(hidden=256, intermediate=768, layers=4, heads=8, kv_heads=2, head_dim=32,
                  vocab=4096, experts=8, experts_per_token=2, expert_intermediate=256),
    # Qwen3-0.6B's width (1024 hidden, 16 q / 8 kv heads of 128, 3072 MLP) on 12 layers
    # and this tokenizer's vocabulary: ~190M parameters, ~770 MB in float32.
    "small": Shape(hidden=1024, intermediate=3072, layers=12, heads=16, kv_heads=8,
                   head_dim=128, vocab=4096, experts=16, experts_per_token=4,
                   expert_intermediate=768),
}


def _corpus_files() -> list[str]:
    libdir = sysconfig.get_paths()["stdlib"]
    files, total = [], 0
    for f in sorted(glob.glob(os.path.join(libdir, "*.py"))):
        files.append(f)
        total += os.path.getsize(f)
        if total > CORPUS_BYTES:
            break
    return files


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 / Qwen style) trained on standard-library sources."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_corpus_files(), trainer)
    return tok


def _config(arch: str, s: Shape, tok: Tokenizer) -> dict:
    cfg = {
        "architectures": [ARCHS[arch]],
        "model_type": arch,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "vocab_size": s.vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "pad_token_id": tok.token_to_id("<|pad|>"),
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if arch == "qwen3_moe":
        cfg.update(num_experts=s.experts, num_local_experts=s.experts,
                   num_experts_per_tok=s.experts_per_token,
                   moe_intermediate_size=s.expert_intermediate, norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
    return cfg


def hot_experts(layer: int, num_experts: int) -> list[int]:
    """The experts ``expert_skew`` favours in a layer: a quarter of them, consecutive (so
    one rank holds them all under the identity placement), a different set per layer."""
    n = max(1, num_experts // 4)
    return [(layer * n + k) % num_experts for k in range(n)]


def _skew_router(w: dict[str, torch.Tensor], s: Shape, skew: float) -> None:
    """Every token's embedding gains a shared component along hidden dimension 0, which
    the residual stream carries through the layers; each layer's hot experts get ``skew``
    added to their router weight on that dimension, so they win the top-k far more often
    than the rest, whatever the token (as real MoE models have hot experts). The shared
    component's share of the normalized hidden state fades as the residual stream grows,
    so the added weight grows with depth to keep every layer about as skewed."""
    w["model.embed_tokens.weight"][:, 0] += 0.3
    for i in range(s.layers):
        gate = w[f"model.layers.{i}.mlp.gate.weight"]  # [E, hidden]
        for e in hot_experts(i, s.experts):
            gate[e, 0] += skew * (1 + i)


def _weights(arch: str, s: Shape, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm(n: int) -> torch.Tensor:  # not all ones, so a loader that drops it is caught
        return 1.0 + normal(n, std=0.1)

    w = {"model.embed_tokens.weight": normal(s.vocab, s.hidden),
         "model.norm.weight": norm(s.hidden),
         "lm_head.weight": normal(s.vocab, s.hidden, std=0.05)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(s.hidden)
        w[p + "post_attention_layernorm.weight"] = norm(s.hidden)
        w[p + "self_attn.q_proj.weight"] = normal(s.heads * s.head_dim, s.hidden)
        w[p + "self_attn.k_proj.weight"] = normal(s.kv_heads * s.head_dim, s.hidden)
        w[p + "self_attn.v_proj.weight"] = normal(s.kv_heads * s.head_dim, s.hidden)
        w[p + "self_attn.o_proj.weight"] = normal(s.hidden, s.heads * s.head_dim)
        if arch in ("qwen3", "qwen3_moe"):
            w[p + "self_attn.q_norm.weight"] = norm(s.head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(s.head_dim)
        if arch == "qwen3_moe":
            w[p + "mlp.gate.weight"] = normal(s.experts, s.hidden, std=0.1)
            for e in range(s.experts):
                q = f"{p}mlp.experts.{e}."
                w[q + "gate_proj.weight"] = normal(s.expert_intermediate, s.hidden)
                w[q + "up_proj.weight"] = normal(s.expert_intermediate, s.hidden)
                w[q + "down_proj.weight"] = normal(s.hidden, s.expert_intermediate)
        else:
            w[p + "mlp.gate_proj.weight"] = normal(s.intermediate, s.hidden)
            w[p + "mlp.up_proj.weight"] = normal(s.intermediate, s.hidden)
            w[p + "mlp.down_proj.weight"] = normal(s.hidden, s.intermediate)
    return w


def make_tiny_model(out: str | Path, arch: str = "qwen3", seed: int = 0, size: str = "tiny",
                    tokenizer: Tokenizer | None = None, expert_skew: float = 0.0) -> Path:
    """Write the model folder; returns its path. ``tokenizer`` reuses a trained one.
    ``expert_skew`` (MoE only): how strongly each layer's router favours a few hot
    experts (see ``_skew_router``); 0 leaves routing as random as the weights make it."""
    if arch not in ARCHS:
        raise ValueError(f"arch: must be one of {', '.join(ARCHS)}, got {arch!r}")
    if expert_skew < 0 or (expert_skew and arch != "qwen3_moe"):
        raise ValueError(f"expert_skew: must be >= 0 and needs --arch qwen3_moe "
                         f"(got {expert_skew} for {arch})")
    if size not in SIZES:
        raise ValueError(f"size: must be one of {', '.join(SIZES)}, got {size!r}")
    shape = SIZES[size]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or train_tokenizer(shape.vocab)
    if tok.get_vocab_size() != shape.vocab:
        raise ValueError(f"tokenizer: vocabulary {tok.get_vocab_size()} != {shape.vocab}")
    tok.save(str(out / "tokenizer.json"))
    cfg = _config(arch, shape, tok)
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", {
        "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"], "do_sample": False})
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
        "unk_token": None, "additional_special_tokens": ["<|im_start|>"],
        "add_bos_token": False, "model_max_length": cfg["max_position_embeddings"],
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE})
    _write_json(out / "special_tokens_map.json", {
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
        "additional_special_tokens": ["<|im_start|>"]})
    weights = _weights(arch, shape, seed)
    if expert_skew:
        _skew_router(weights, shape, expert_skew)
    weights = {k: v.contiguous() for k, v in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def add_args(m: argparse.ArgumentParser) -> None:
    m.add_argument("out")
    m.add_argument("--arch", choices=list(ARCHS), default="qwen3")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--size", choices=list(SIZES), default="tiny")
    m.add_argument("--expert-skew", type=float, default=0.0,
                   help="qwen3_moe: bias each layer's router toward a quarter of its "
                        "experts (0: off; 0.3 sends them about 2/3 of the routed tokens)")


def run(a: argparse.Namespace) -> int:
    out = make_tiny_model(a.out, a.arch, seed=a.seed, size=a.size, expert_skew=a.expert_skew)
    print(f"wrote {a.size} {a.arch} model (seed {a.seed}) to {out}")
    return 0
