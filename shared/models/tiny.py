"""A randomly initialized model folder, made offline (``make_tiny_model``; the command,
`pdmesh make-tiny-model`, and its ``--train`` are ``pdmesh.shared.cli.make_tiny_model``).

No model hub is reachable here, so tests and demos use these. The folder is an ordinary
Hugging Face checkpoint (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template, generation_config.json) and loads through
the same code as a real one. The tokenizer is a byte-level BPE trained on this
Python's standard-library sources (tiny_tokenizer.py); weights are drawn from a seeded
generator, so the same seed and size give the same files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from pdmesh.shared.models.tiny_tokenizer import (
    TokenizerSpec,
    check_tokenizer,
    tokenizer_config_files,
    tokenizer_spec,
    train_tokenizer,
)

ARCHS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
         "deepseek_v4": "DeepseekV4ForCausalLM"}
MOE_ARCHS = ("qwen3_moe", "deepseek_v3", "deepseek_v4")


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
    # weights dominate a decode step (~57M parameters, ~230 MB in float32): the size the
    # quantization benchmarks run on
    "medium": Shape(hidden=768, intermediate=2048, layers=8, heads=12, kv_heads=4,
                    head_dim=64, vocab=4096, experts=8, experts_per_token=2,
                    expert_intermediate=1024),
    # Qwen3-0.6B's width (1024 hidden, 16 q / 8 kv heads of 128, 3072 MLP) on 12 layers
    # and this tokenizer's vocabulary: ~190M parameters, ~770 MB in float32.
    "small": Shape(hidden=1024, intermediate=3072, layers=12, heads=16, kv_heads=8,
                   head_dim=128, vocab=4096, experts=16, experts_per_token=4,
                   expert_intermediate=768),
}


@dataclass(frozen=True)
class DeepSeekShape:
    """DeepSeek-V3's extra dimensions (MLA, DeepSeekMoE, MTP) for a tiny checkpoint."""

    q_lora_rank: int | None = 96  # None: q straight from the hidden state
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    n_group: int = 4  # 1: ungrouped routing
    topk_group: int = 2
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 2.5
    yarn: bool = False  # rope_scaling yarn (factor 4 from 1024) with mscale 0.707
    num_nextn_predict_layers: int = 1


@dataclass(frozen=True)
class DeepSeekV4Shape:
    """DeepSeek-V4's extra dimensions for a tiny checkpoint. ``layer_types`` cycles over
    the layers: "s" sliding only, "c" CSA (rate ``csa_rate``), "h" HCA (``hca_rate``)."""

    head_dim: int = 64
    rope_dim: int = 16
    q_lora_rank: int = 64
    o_groups: int = 2
    o_lora_rank: int = 32
    window: int = 16
    layer_types: str = "schc"
    csa_rate: int = 4
    hca_rate: int = 16
    index_heads: int = 8
    index_head_dim: int = 32
    index_topk: int = 8
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    num_hash_layers: int = 1
    scoring_func: str = "sqrtsoftplus"
    swiglu_limit: float = 10.0
    routed_scaling_factor: float = 1.5
    yarn: bool = True  # the compressed layers' rope: yarn (factor 4 from 1024)
    num_nextn_predict_layers: int = 1

    def layer_kinds(self, n: int) -> list[str]:
        kinds = {"s": "sliding_attention", "c": "compressed_sparse_attention",
                 "h": "heavily_compressed_attention"}
        return [kinds[self.layer_types[i % len(self.layer_types)]] for i in range(n)]

    def rate(self, kind: str) -> int:
        return {"sliding_attention": 0, "compressed_sparse_attention": self.csa_rate,
                "heavily_compressed_attention": self.hca_rate}[kind]


def _config(arch: str, s: Shape, tok: Tokenizer, spec: TokenizerSpec) -> dict:
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
        "bos_token_id": tok.token_to_id(spec.bos),
        "eos_token_id": tok.token_to_id(spec.eos),
        "pad_token_id": tok.token_to_id(spec.pad),
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if arch == "qwen3_moe":
        cfg.update(num_experts=s.experts, num_local_experts=s.experts,
                   num_experts_per_tok=s.experts_per_token,
                   moe_intermediate_size=s.expert_intermediate, norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
    return cfg


def _deepseek_config(cfg: dict, s: Shape, d: DeepSeekShape) -> dict:
    """config.json as DeepSeek-V3's official checkpoints write it."""
    for key in ("num_experts", "num_local_experts", "decoder_sparse_step", "mlp_only_layers",
                "head_dim"):
        cfg.pop(key, None)
    cfg.update(
        num_key_value_heads=s.heads, q_lora_rank=d.q_lora_rank, kv_lora_rank=d.kv_lora_rank,
        qk_nope_head_dim=d.qk_nope_head_dim, qk_rope_head_dim=d.qk_rope_head_dim,
        v_head_dim=d.v_head_dim, n_routed_experts=s.experts, n_shared_experts=d.n_shared_experts,
        num_experts_per_tok=s.experts_per_token, moe_intermediate_size=s.expert_intermediate,
        n_group=d.n_group, topk_group=d.topk_group, topk_method="noaux_tc",
        scoring_func="sigmoid", norm_topk_prob=True,
        routed_scaling_factor=d.routed_scaling_factor,
        first_k_dense_replace=d.first_k_dense_replace, moe_layer_freq=1,
        num_nextn_predict_layers=d.num_nextn_predict_layers, rope_interleave=True,
        ep_size=1)
    if d.yarn:
        cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 1024, "beta_fast": 32,
                               "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
    return cfg


def _deepseek_v4_config(cfg: dict, s: Shape, d: DeepSeekV4Shape) -> dict:
    """config.json in DeepSeek-V4's own spelling (compress_ratios per layer and MTP
    layer, num_hash_layers, qk_rope_head_dim, rope_scaling), plus transformers'
    layer_types / compress_rates, which name the rates compress_ratios cannot (an HCA
    rate other than 128)."""
    for key in ("num_experts", "num_local_experts", "decoder_sparse_step", "mlp_only_layers",
                "intermediate_size"):
        cfg.pop(key, None)
    kinds = d.layer_kinds(s.layers)
    cfg.update(
        num_key_value_heads=1, head_dim=d.head_dim, qk_rope_head_dim=d.rope_dim,
        q_lora_rank=d.q_lora_rank, o_groups=d.o_groups, o_lora_rank=d.o_lora_rank,
        n_routed_experts=s.experts, n_shared_experts=1, num_experts_per_tok=s.experts_per_token,
        moe_intermediate_size=s.expert_intermediate, scoring_func=d.scoring_func,
        norm_topk_prob=True, routed_scaling_factor=d.routed_scaling_factor,
        swiglu_limit=d.swiglu_limit, sliding_window=d.window,
        compress_ratios=[d.rate(k) for k in kinds] + [0] * d.num_nextn_predict_layers,
        layer_types=kinds,
        compress_rates={"compressed_sparse_attention": d.csa_rate,
                        "heavily_compressed_attention": d.hca_rate},
        compress_rope_theta=160000.0, num_hash_layers=d.num_hash_layers,
        index_n_heads=d.index_heads, index_head_dim=d.index_head_dim,
        index_topk=d.index_topk, hc_mult=d.hc_mult, hc_sinkhorn_iters=d.hc_sinkhorn_iters,
        hc_eps=1e-6, num_nextn_predict_layers=d.num_nextn_predict_layers)
    if d.yarn:
        cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 1024, "beta_fast": 32,
                               "beta_slow": 1}
    return cfg


def _deepseek_v4_weights(s: Shape, d: DeepSeekV4Shape, seed: int) -> dict[str, torch.Tensor]:
    """DeepSeek-V4's official layout (the names its inference code uses, which
    transformers renames on load): ``embed``, ``layers.{i}.attn`` / ``ffn`` /
    ``hc_*``, ``head``, ``hc_head_*``, and the MTP blocks under ``mtp.{i}``."""
    r = _Draw(seed)
    hc = d.hc_mult
    w = {"embed.weight": r.normal(s.vocab, s.hidden),
         "norm.weight": r.norm(s.hidden),
         "head.weight": r.normal(s.vocab, s.hidden, std=0.05),
         "hc_head_fn": r.normal(hc, hc * s.hidden, std=0.1),
         "hc_head_base": r.normal(hc, std=0.1),
         "hc_head_scale": 1.0 + r.normal(1, std=0.1)}
    kinds = d.layer_kinds(s.layers)
    for i, kind in enumerate(kinds):
        w.update(_deepseek_v4_block(r, f"layers.{i}.", s, d, kind, hashed=i < d.num_hash_layers))
    for i in range(d.num_nextn_predict_layers):
        p = f"mtp.{i}."
        w.update(_deepseek_v4_block(r, p, s, d, "sliding_attention", hashed=False))
        w[p + "e_proj.weight"] = r.normal(s.hidden, s.hidden)
        w[p + "h_proj.weight"] = r.normal(s.hidden, s.hidden)
        w[p + "enorm.weight"] = r.norm(s.hidden)
        w[p + "hnorm.weight"] = r.norm(s.hidden)
        w[p + "norm.weight"] = r.norm(s.hidden)
        w[p + "hc_head_fn"] = r.normal(hc, hc * s.hidden, std=0.1)
        w[p + "hc_head_base"] = r.normal(hc, std=0.1)
        w[p + "hc_head_scale"] = 1.0 + r.normal(1, std=0.1)
    return w


def _deepseek_v4_block(r: _Draw, p: str, s: Shape, d: DeepSeekV4Shape, kind: str,
                       hashed: bool) -> dict[str, torch.Tensor]:
    hc, mix = d.hc_mult, (2 + d.hc_mult) * d.hc_mult
    a = p + "attn."
    w = {p + "attn_norm.weight": r.norm(s.hidden), p + "ffn_norm.weight": r.norm(s.hidden)}
    for site in ("attn", "ffn"):
        w[f"{p}hc_{site}_fn"] = r.normal(mix, hc * s.hidden, std=0.1)
        w[f"{p}hc_{site}_base"] = r.normal(mix, std=0.1)
        w[f"{p}hc_{site}_scale"] = 1.0 + r.normal(3, std=0.1)
    w.update({
        a + "wq_a.weight": r.normal(d.q_lora_rank, s.hidden, std=0.05),
        a + "q_norm.weight": r.norm(d.q_lora_rank),
        a + "wq_b.weight": r.normal(s.heads * d.head_dim, d.q_lora_rank, std=0.1),
        a + "wkv.weight": r.normal(d.head_dim, s.hidden, std=0.05),
        a + "kv_norm.weight": r.norm(d.head_dim),
        a + "wo_a.weight": r.normal(d.o_groups * d.o_lora_rank,
                                    s.heads * d.head_dim // d.o_groups, std=0.05),
        a + "wo_b.weight": r.normal(s.hidden, d.o_groups * d.o_lora_rank, std=0.05),
        a + "attn_sink": r.normal(s.heads, std=1.0)})
    rate = d.rate(kind)
    if rate:
        overlap = 2 if kind == "compressed_sparse_attention" else 1
        c = a + "compressor."
        w[c + "wkv.weight"] = r.normal(overlap * d.head_dim, s.hidden, std=0.05)
        w[c + "wgate.weight"] = r.normal(overlap * d.head_dim, s.hidden, std=0.2)
        w[c + "ape"] = r.normal(rate, overlap * d.head_dim, std=0.5)
        w[c + "norm.weight"] = r.norm(d.head_dim)
    if kind == "compressed_sparse_attention":
        x = a + "indexer."
        w[x + "wq_b.weight"] = r.normal(d.index_heads * d.index_head_dim, d.q_lora_rank,
                                        std=0.1)
        w[x + "weights_proj.weight"] = r.normal(d.index_heads, s.hidden, std=0.2)
        w[x + "compressor.wkv.weight"] = r.normal(2 * d.index_head_dim, s.hidden, std=0.05)
        w[x + "compressor.wgate.weight"] = r.normal(2 * d.index_head_dim, s.hidden, std=0.2)
        w[x + "compressor.ape"] = r.normal(d.csa_rate, 2 * d.index_head_dim, std=0.5)
        w[x + "compressor.norm.weight"] = r.norm(d.index_head_dim)
    f = p + "ffn."
    w[f + "gate.weight"] = r.normal(s.experts, s.hidden, std=0.1)
    if hashed:  # a fixed token -> experts table, distinct experts per token
        w[f + "gate.tid2eid"] = torch.stack([
            torch.randperm(s.experts, generator=r.g)[:s.experts_per_token]
            for _ in range(s.vocab)])
    else:
        w[f + "gate.bias"] = r.normal(s.experts, std=0.05)
    for e in range(s.experts):
        q = f"{f}experts.{e}."
        w[q + "w1.weight"] = r.normal(s.expert_intermediate, s.hidden)
        w[q + "w3.weight"] = r.normal(s.expert_intermediate, s.hidden)
        w[q + "w2.weight"] = r.normal(s.hidden, s.expert_intermediate)
    w[f + "shared_experts.w1.weight"] = r.normal(s.expert_intermediate, s.hidden)
    w[f + "shared_experts.w3.weight"] = r.normal(s.expert_intermediate, s.hidden)
    w[f + "shared_experts.w2.weight"] = r.normal(s.hidden, s.expert_intermediate)
    return w


def hot_experts(layer: int, num_experts: int) -> list[int]:
    """The experts ``expert_skew`` favours in a layer: a quarter of them, consecutive (so
    one rank holds them all under the identity placement), a different set per layer."""
    n = max(1, num_experts // 4)
    return [(layer * n + k) % num_experts for k in range(n)]


def _skew_router(w: dict[str, torch.Tensor], s: Shape, skew: float, first_moe: int = 0,
                 embed: str = "model.embed_tokens.weight",
                 gate: str = "model.layers.{}.mlp.gate.weight") -> None:
    """Every token's embedding gains a shared component along hidden dimension 0, which
    the residual stream carries through the layers; each layer's hot experts get ``skew``
    added to their router weight on that dimension, so they win the top-k far more often
    than the rest, whatever the token (as real MoE models have hot experts). The shared
    component's share of the normalized hidden state fades as the residual stream grows,
    so the added weight grows with depth to keep every layer about as skewed."""
    w[embed][:, 0] += 0.3
    for i in range(first_moe, s.layers):
        router = w[gate.format(i)]  # [E, hidden]
        for e in hot_experts(i, s.experts):
            router[e, 0] += skew * (1 + i)


class _Draw:
    """Seeded random tensors."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g) * std

    def norm(self, n: int) -> torch.Tensor:  # not all ones: a loader that drops it is caught
        return 1.0 + self.normal(n, std=0.1)


def _deepseek_weights(s: Shape, d: DeepSeekShape, seed: int) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's official layout: MLA, dense then DeepSeekMoE layers, and the MTP
    layers after the decoder layers (model.layers.{num_hidden_layers + i})."""
    r = _Draw(seed)
    w = {"model.embed_tokens.weight": r.normal(s.vocab, s.hidden),
         "model.norm.weight": r.norm(s.hidden),
         "lm_head.weight": r.normal(s.vocab, s.hidden, std=0.05)}
    for i in range(s.layers + d.num_nextn_predict_layers):
        p = f"model.layers.{i}."
        w.update(_deepseek_layer(r, p, s, d, moe=i >= d.first_k_dense_replace))
        if i >= s.layers:  # an MTP layer: its own norms, projection and head
            w[p + "enorm.weight"] = r.norm(s.hidden)
            w[p + "hnorm.weight"] = r.norm(s.hidden)
            w[p + "eh_proj.weight"] = r.normal(s.hidden, 2 * s.hidden)
            w[p + "shared_head.norm.weight"] = r.norm(s.hidden)
            w[p + "shared_head.head.weight"] = r.normal(s.vocab, s.hidden, std=0.05)
            w[p + "embed_tokens.weight"] = w["model.embed_tokens.weight"].clone()
    return w


def _deepseek_layer(r: _Draw, p: str, s: Shape, d: DeepSeekShape, moe: bool
                    ) -> dict[str, torch.Tensor]:
    qk = d.qk_nope_head_dim + d.qk_rope_head_dim
    a = p + "self_attn."
    w = {p + "input_layernorm.weight": r.norm(s.hidden),
         p + "post_attention_layernorm.weight": r.norm(s.hidden),
         a + "kv_a_proj_with_mqa.weight": r.normal(d.kv_lora_rank + d.qk_rope_head_dim,
                                                   s.hidden, std=0.05),
         a + "kv_a_layernorm.weight": r.norm(d.kv_lora_rank),
         a + "kv_b_proj.weight": r.normal(s.heads * (d.qk_nope_head_dim + d.v_head_dim),
                                          d.kv_lora_rank, std=0.05),
         a + "o_proj.weight": r.normal(s.hidden, s.heads * d.v_head_dim)}
    if d.q_lora_rank is None:
        w[a + "q_proj.weight"] = r.normal(s.heads * qk, s.hidden, std=0.05)
    else:
        w[a + "q_a_proj.weight"] = r.normal(d.q_lora_rank, s.hidden, std=0.05)
        w[a + "q_a_layernorm.weight"] = r.norm(d.q_lora_rank)
        w[a + "q_b_proj.weight"] = r.normal(s.heads * qk, d.q_lora_rank, std=0.05)
    m = p + "mlp."
    if not moe:
        w[m + "gate_proj.weight"] = r.normal(s.intermediate, s.hidden)
        w[m + "up_proj.weight"] = r.normal(s.intermediate, s.hidden)
        w[m + "down_proj.weight"] = r.normal(s.hidden, s.intermediate)
        return w
    w[m + "gate.weight"] = r.normal(s.experts, s.hidden, std=0.1)
    w[m + "gate.e_score_correction_bias"] = r.normal(s.experts, std=0.05)
    for e in range(s.experts):
        q = f"{m}experts.{e}."
        w[q + "gate_proj.weight"] = r.normal(s.expert_intermediate, s.hidden)
        w[q + "up_proj.weight"] = r.normal(s.expert_intermediate, s.hidden)
        w[q + "down_proj.weight"] = r.normal(s.hidden, s.expert_intermediate)
    shared = s.expert_intermediate * d.n_shared_experts
    w[m + "shared_experts.gate_proj.weight"] = r.normal(shared, s.hidden)
    w[m + "shared_experts.up_proj.weight"] = r.normal(shared, s.hidden)
    w[m + "shared_experts.down_proj.weight"] = r.normal(s.hidden, shared)
    return w


def _weights(arch: str, s: Shape, seed: int) -> dict[str, torch.Tensor]:
    r = _Draw(seed)
    normal, norm = r.normal, r.norm
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
                    tokenizer: Tokenizer | None = None, expert_skew: float = 0.0,
                    deepseek: DeepSeekShape | None = None,
                    deepseek_v4: DeepSeekV4Shape | None = None) -> Path:
    """Write the model folder; returns its path. ``tokenizer`` reuses a trained one.
    ``expert_skew`` (MoE only): how strongly each layer's router favours a few hot
    experts (see ``_skew_router``); 0 leaves routing as random as the weights make it.
    ``deepseek``: DeepSeek-V3's extra dimensions (default ``DeepSeekShape()``);
    ``deepseek_v4``: DeepSeek-V4's (default ``DeepSeekV4Shape()``). On DeepSeek-V4 the
    skew acts on the learned-router layers (hash layers pick experts by token id)."""
    if arch not in ARCHS:
        raise ValueError(f"arch: must be one of {', '.join(ARCHS)}, got {arch!r}")
    if expert_skew < 0 or (expert_skew and arch not in MOE_ARCHS):
        raise ValueError(f"expert_skew: must be >= 0 and needs a MoE --arch "
                         f"({', '.join(MOE_ARCHS)}; got {expert_skew} for {arch})")
    if size not in SIZES:
        raise ValueError(f"size: must be one of {', '.join(SIZES)}, got {size!r}")
    shape = SIZES[size]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = tokenizer_spec(arch)
    tok = tokenizer or train_tokenizer(shape.vocab, spec)
    if tok.get_vocab_size() != shape.vocab:
        raise ValueError(f"tokenizer: vocabulary {tok.get_vocab_size()} != {shape.vocab}")
    check_tokenizer(tok, spec, arch)
    tok.save(str(out / "tokenizer.json"))
    cfg = _config(arch, shape, tok, spec)
    ds = deepseek or DeepSeekShape()
    ds4 = deepseek_v4 or DeepSeekV4Shape()
    if arch == "deepseek_v3":
        cfg = _deepseek_config(cfg, shape, ds)
    elif arch == "deepseek_v4":
        cfg = _deepseek_v4_config(cfg, shape, ds4)
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", {
        "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"], "do_sample": False})
    for name, content in tokenizer_config_files(spec, cfg["max_position_embeddings"]).items():
        _write_json(out / name, content)
    if arch == "deepseek_v3":
        weights = _deepseek_weights(shape, ds, seed)
    elif arch == "deepseek_v4":
        weights = _deepseek_v4_weights(shape, ds4, seed)
    else:
        weights = _weights(arch, shape, seed)
    if expert_skew and arch == "deepseek_v4":
        _skew_router(weights, shape, expert_skew, ds4.num_hash_layers, embed="embed.weight",
                     gate="layers.{}.ffn.gate.weight")
    elif expert_skew:
        first_moe = ds.first_k_dense_replace if arch == "deepseek_v3" else 0
        _skew_router(weights, shape, expert_skew, first_moe)
    weights = {k: v.contiguous() for k, v in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")

