"""A model folder's config.json, read into one frozen dataclass.

Field names follow Hugging Face's; the spellings that differ between transformers
releases (``rope_theta`` vs ``rope_parameters``, ``num_experts`` vs
``num_local_experts``, ``torch_dtype`` vs ``dtype``) are reconciled here, once.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pdmesh.shared.parallel.tensor_parallel import Shard

DTYPES = ("float32", "bfloat16", "float16")  # what --dtype names (torch's names)
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                 "half": "float16"}


def parse_dtype(name: str | torch.dtype | None, default: str = "float32") -> torch.dtype:
    """``--dtype`` value -> torch dtype; ValueError naming the field otherwise. (torch is
    imported here, not with the module: the gateway reads model configs without it.)"""
    import torch

    if isinstance(name, torch.dtype):
        if name not in {getattr(torch, d) for d in DTYPES}:
            raise ValueError(f"dtype: unsupported {name}; use float32, bfloat16 or float16")
        return name
    if name in (None, "auto"):
        name = default
    key = DTYPE_ALIASES.get(str(name), str(name))
    if key not in DTYPES:
        raise ValueError(f"dtype: unsupported {name!r}; use auto, float32, bfloat16 or float16")
    return getattr(torch, key)


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    # layer i is MoE iff i >= first_dense_layers, i not in mlp_only_layers and
    # (i + 1) % decoder_sparse_step == 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # DeepSeekMoE: sigmoid scores plus a correction bias choose the experts, within the
    # best ``topk_groups`` of ``num_groups`` groups; weights scaled by routed_scaling
    scoring: str = "softmax"  # softmax | sigmoid | sqrtsoftplus (DeepSeek-V4)
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    num_shared_experts: int = 0  # dense experts every token goes through (DeepSeek)
    first_dense_layers: int = 0  # DeepSeek's first_k_dense_replace

    def is_moe_layer(self, layer: int) -> bool:
        return (layer >= self.first_dense_layers and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention: K and V come from one compressed latent of
    ``kv_lora_rank`` per token plus a shared rotary key of ``qk_rope_head_dim``; the
    paged cache stores exactly those (one "head" of their sum)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None  # None: q straight from the hidden state
    softmax_scale: float  # qk_head_dim^-0.5, times yarn's mscale_all_dim factor squared
    rope_interleave: bool = True  # rotary pairs (x0, x1), (x2, x3), ...

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", \
    "heavily_compressed_attention"


@dataclass(frozen=True)
class V4Config:
    """DeepSeek-V4's own dimensions. Every layer attends over a sliding window of its
    one shared K=V head; a compressed layer also attends over entries that each
    summarize ``rate`` tokens (CSA: overlapping windows of 2 * rate, of which a lightning
    indexer picks ``index_topk`` per query; HCA: disjoint windows, all of them)."""

    head_dim: int  # D: the one K=V head, and each query head
    rope_dim: int  # its last rope_dim dims are rotary (interleaved pairs)
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int  # sliding window, the query's own token included
    layer_types: tuple[str, ...]  # per layer: SLIDING, CSA or HCA
    compress_rates: tuple[int, ...]  # per layer: 0 (sliding only) or its rate
    index_heads: int
    index_head_dim: int
    index_topk: int
    compress_rope_theta: float
    compress_rope_scaling: dict[str, Any] | None  # yarn, for the compressed layers only
    hc_mult: int  # hyper-connection streams
    hc_sinkhorn_iters: int
    hc_eps: float
    hash_layers: tuple[bool, ...]  # per layer: experts chosen by token id (hash MoE)
    swiglu_limit: float  # clamp of the experts' gate (above) and up (both sides); 0: off

    @property
    def state_window(self) -> int:
        """Tokens behind the next one to compute whose window keys and compressor inputs
        must stay in the cache: the window's, and (CSA) the previous compression window
        that overlaps the current one, or (HCA) the current one."""
        keep = self.window - 1
        for kind, rate in zip(self.layer_types, self.compress_rates, strict=True):
            if kind == CSA:
                keep = max(keep, 2 * rate - 1)
            elif kind == HCA:
                keep = max(keep, rate - 1)
        return keep


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    dtype: str
    # what ends a sequence (config.json's, generation_config.json's); from_folder puts the
    # tokenizer's own first (the one that ends a request without a stop_reason)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    rope_scaling: dict[str, Any] | None = None
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    v4: V4Config | None = None
    num_nextn_predict_layers: int = 0  # MTP layers after the decoder layers (not decoders)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # -- the paged KV cache's layout, per layer --------------------------------------------
    @property
    def kv_cache_tensors(self) -> int:
        """Cache tensors per layer: K and V, or MLA's one latent."""
        return 1 if self.mla is not None else 2

    @property
    def kv_cache_heads(self) -> int:
        return 1 if self.mla is not None else self.num_kv_heads

    @property
    def kv_cache_dim(self) -> int:
        return self.mla.latent_dim if self.mla is not None else self.head_dim

    @property
    def rotary_dim(self) -> int:
        if self.v4 is not None:
            return self.v4.rope_dim
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        from pdmesh.shared.models.registry import architecture_traits

        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json: missing 'architectures'")
        arch = archs[0]
        traits = architecture_traits(arch)
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if key not in cfg:
                raise ValueError(f"config.json: missing {key!r} (architecture {arch})")
        heads = int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default")
                                              not in ("default", None) else None)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        moe = _moe_config(cfg, arch) if traits.moe else None
        mla = _mla_config(cfg, arch, scaling) if traits.mla else None
        v4 = _v4_config(cfg, scaling) if traits.v4 else None
        if v4 is not None:  # the sliding layers' rope is plain; yarn is the compressed ones'
            scaling = None
        return cls(
            architecture=arch,
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg.get("intermediate_size", 4 * cfg["hidden_size"])),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(mla.qk_rope_head_dim if mla else cfg.get("head_dim")
                         or cfg["hidden_size"] // heads),
            v4=v4,
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", (rope.get("main") or rope).get("rope_theta",
                                                                          10000.0))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=traits.qkv_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=traits.qk_norm,
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            rope_scaling=scaling,
            moe=moe,
            mla=mla,
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
            raw=cfg,
        )

    @classmethod
    def from_folder(cls, path: str | Path, overrides: dict[str, Any] | None = None
                    ) -> ModelConfig:
        """``overrides``: vLLM's --hf-overrides (SGLang's --json-model-override-args),
        laid over config.json (``check_overrides`` says which keys may be)."""
        p = Path(path) / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"model: {p} not found (a model folder needs config.json)")
        with open(p) as f:
            cfg = cls.from_dict({**json.load(f), **check_overrides(overrides)})
        extra = _generation_eos(Path(path) / "generation_config.json")
        ids = cfg.eos_token_ids + tuple(t for t in extra if t not in cfg.eos_token_ids)
        own = _tokenizer_eos(Path(path) / "tokenizer_config.json")
        if own in ids:  # first: the model's own end of sequence (Llama 3's <|eot_id|>)
            ids = (own, *(t for t in ids if t != own))
        return dataclasses.replace(cfg, eos_token_ids=ids) if ids != cfg.eos_token_ids else cfg


# config.json keys --hf-overrides may set: the positions the model takes and how it
# rotates them. Any other key would change what the checkpoint's weights mean (their
# shapes, their kernels): refused, never half-applied.
OVERRIDABLE = ("rope_scaling", "rope_parameters", "rope_theta", "max_position_embeddings")


def check_overrides(overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``overrides`` if each key may be overridden; ValueError naming one that may
    not."""
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise ValueError(f"--hf-overrides: must be a JSON object, got {overrides!r}")
    for key in overrides:
        if key not in OVERRIDABLE:
            raise ValueError(f"--hf-overrides: {key}: pdmesh overrides only "
                             f"{', '.join(OVERRIDABLE)} (another key would change what "
                             f"the checkpoint's weights mean)")
    return overrides


def local_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The model as one rank computes it: its query heads, K / V heads and MLP and
    expert widths, DeepSeek-V4's output groups (everything else, the vocabulary
    included, as it is)."""
    heads = cfg.num_heads // shard.size
    shard.part(cfg.num_heads, "num_attention_heads")
    kv = shard.kv_heads(cfg.num_kv_heads)
    changes: dict = {"num_heads": heads, "num_kv_heads": kv.stop - kv.start}
    if cfg.intermediate_size:
        shard.part(cfg.intermediate_size, "intermediate_size")
        changes["intermediate_size"] = cfg.intermediate_size // shard.size
    if cfg.moe is not None and shard.experts:
        shard.part(cfg.moe.intermediate_size, "moe_intermediate_size")
        changes["moe"] = dataclasses.replace(
            cfg.moe, intermediate_size=cfg.moe.intermediate_size // shard.size)
    if cfg.v4 is not None:  # DeepSeek-V4: its output projection's groups, whole heads each
        shard.part(cfg.v4.o_groups, "o_groups")
        changes["v4"] = dataclasses.replace(cfg.v4, o_groups=cfg.v4.o_groups // shard.size)
    return dataclasses.replace(cfg, **changes)


def _generation_eos(path: Path) -> tuple[int, ...]:
    """The end-of-sequence ids a generation_config.json names: they end a request too
    (vLLM adds them to its stop ids; Qwen's and Llama's chat models name two or three)."""
    if not path.is_file():
        return ()
    try:
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
    except (ValueError, AttributeError):
        raise ValueError(f"model: {path} is not a JSON object") from None
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"model: {path}: eos_token_id must be token ids, got {eos!r}")
    return tuple(ids)


def _tokenizer_eos(path: Path) -> int | None:
    """The id of the end of sequence tokenizer_config.json names, when its
    added_tokens_decoder lists it: the tokenizer's eos_token_id, the one vLLM gives no
    stop_reason (config.json may list others first: Llama 3.1's [128001, 128008, 128009]
    for <|eot_id|>, 128009)."""
    try:
        with open(path) as f:
            config = json.load(f)
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        for tid, token in (config.get("added_tokens_decoder") or {}).items():
            if isinstance(token, dict) and eos is not None and token.get("content") == eos:
                return int(tid)
    except (OSError, ValueError, AttributeError):
        pass  # (the tokenizer's own checks report a broken file)
    return None


def _moe_config(cfg: dict[str, Any], arch: str) -> MoEConfig:
    n_exp = cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts")))
    if n_exp is None:
        raise ValueError(f"config.json: missing 'num_experts' (architecture {arch})")
    deepseek = "n_routed_experts" in cfg
    v4 = arch == "DeepseekV4ForCausalLM"
    scoring = str(cfg.get("scoring_func",
                          "sqrtsoftplus" if v4 else "sigmoid" if deepseek else "softmax"))
    allowed = ("softmax", "sigmoid", "sqrtsoftplus") if v4 else ("softmax", "sigmoid")
    if scoring not in allowed:
        raise ValueError(f"config.json: scoring_func {scoring!r} is not supported "
                         f"({', '.join(allowed)})")
    if v4 and int(cfg.get("n_shared_experts", 1) or 0) != 1:
        raise ValueError("config.json: n_shared_experts must be 1 for DeepseekV4ForCausalLM "
                         "(one shared expert of moe_intermediate_size)")
    topk_method = cfg.get("topk_method", "noaux_tc" if deepseek else None)
    if topk_method not in (None, "noaux_tc", "greedy", "group_limited_greedy"):
        raise ValueError(f"config.json: topk_method {topk_method!r} is not supported")
    groups = int(cfg.get("n_group") or 1)
    if int(n_exp) % groups:
        raise ValueError(f"config.json: n_group {groups} does not divide the {n_exp} experts")
    return MoEConfig(
        num_experts=int(n_exp),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        scoring=scoring,
        num_groups=groups,
        topk_groups=int(cfg.get("topk_group") or 1),
        routed_scaling=float(cfg.get("routed_scaling_factor") or 1.0),
        num_shared_experts=int(cfg.get("n_shared_experts", 1 if v4 else 0) or 0),
        first_dense_layers=int(cfg.get("first_k_dense_replace") or 0),
    )


def _mla_config(cfg: dict[str, Any], arch: str, scaling: dict[str, Any] | None) -> MLAConfig:
    from pdmesh.shared.models.rotary import yarn_mscale

    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not cfg.get(key):
            raise ValueError(f"config.json: missing {key!r} (architecture {arch})")
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    scale = (nope + rope) ** -0.5
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in (None, "default") and (scaling or {}).get("mscale_all_dim"):
        m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= m * m
    q_lora = cfg.get("q_lora_rank")
    return MLAConfig(
        kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
        v_head_dim=int(cfg["v_head_dim"]), q_lora_rank=int(q_lora) if q_lora else None,
        softmax_scale=scale, rope_interleave=bool(cfg.get("rope_interleave", True)))


_RATIO_TYPES = {0: SLIDING, 1: SLIDING, 4: CSA}  # compress_ratios: any other rate is HCA


def _v4_config(cfg: dict[str, Any], scaling: dict[str, Any] | None) -> V4Config:
    """DeepSeek-V4's config.json, in either spelling: DeepSeek's own (``compress_ratios``
    per layer, 0 or 1 for sliding-only and 4 for CSA, ``num_hash_layers``,
    ``qk_rope_head_dim``, ``rope_scaling``) or transformers' (``layer_types``,
    ``compress_rates``, ``mlp_layer_types``, ``partial_rotary_factor``, nested
    ``rope_parameters``). Both given: layer_types names the kinds, and the rates must
    agree."""
    n = int(cfg["num_hidden_layers"])
    for key in ("head_dim", "q_lora_rank", "o_groups", "o_lora_rank"):
        if not cfg.get(key):
            raise ValueError(f"config.json: missing {key!r} (architecture DeepseekV4ForCausalLM)")
    head_dim = int(cfg["head_dim"])
    if cfg.get("qk_rope_head_dim"):
        rope_dim = int(cfg["qk_rope_head_dim"])
    else:
        rope_dim = int(head_dim * float(cfg.get("partial_rotary_factor") or 64 / 512))
    if not 0 < rope_dim <= head_dim or rope_dim % 2:
        raise ValueError(f"config.json: qk_rope_head_dim {rope_dim} must be even and at most "
                         f"head_dim ({head_dim})")
    rates_by_type = {CSA: 4, HCA: 128, **(cfg.get("compress_rates") or {})}
    types = rates = None
    if cfg.get("layer_types") is not None:
        types = tuple(cfg["layer_types"][:n])
        bad = sorted({t for t in types if t not in (SLIDING, CSA, HCA)})
        if bad:
            raise ValueError(f"config.json: layer_types {bad} are not DeepSeek-V4 layer types")
        rates = tuple(0 if t == SLIDING else int(rates_by_type[t]) for t in types)
    if cfg.get("compress_ratios") is not None:
        ratios = [int(r) for r in cfg["compress_ratios"][:n]]
        ratio_rates = tuple(0 if r <= 1 else r for r in ratios)
        if types is None:
            types = tuple(_RATIO_TYPES.get(r, HCA) for r in ratios)
            rates = ratio_rates
        elif rates != ratio_rates:  # (the kind, CSA or HCA, is layer_types' to say)
            raise ValueError("config.json: compress_ratios and layer_types / compress_rates "
                             "disagree on the layers' compress rates")
    if types is None or rates is None:
        raise ValueError("config.json: missing 'compress_ratios' or 'layer_types' "
                         "(architecture DeepseekV4ForCausalLM)")
    if len(types) != n:
        raise ValueError(f"config.json: {len(types)} layer types for {n} layers")
    if any(r < 0 for r in rates):
        raise ValueError("config.json: compress rates must be positive")
    if cfg.get("mlp_layer_types") is not None:
        mlp_types = list(cfg["mlp_layer_types"][:n])
        bad = sorted({t for t in mlp_types if t not in ("hash_moe", "moe")})
        if bad or len(mlp_types) != n:
            raise ValueError(f"config.json: mlp_layer_types must list hash_moe / moe for each "
                             f"of the {n} layers")
        hashed = tuple(t == "hash_moe" for t in mlp_types)
    else:
        k = int(cfg.get("num_hash_layers", 3) or 0)
        hashed = tuple(i < k for i in range(n))
    heads, groups = int(cfg["num_attention_heads"]), int(cfg["o_groups"])
    if heads % groups:
        raise ValueError(f"config.json: o_groups {groups} does not divide the {heads} heads")
    rp = cfg.get("rope_parameters") or {}
    if isinstance(rp.get("compress"), dict):
        compress = dict(rp["compress"])
        theta = float(compress.get("rope_theta", cfg.get("compress_rope_theta", 160000.0)))
    else:
        compress = dict(scaling or {})
        theta = float(cfg.get("compress_rope_theta", 160000.0))
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind not in (None, "default", "yarn"):
        raise ValueError(f"config.json: rope type {kind!r} for the compressed layers is not "
                         "supported (default or yarn)")
    if kind == "yarn":
        # DeepSeek-V4 leaves cos / sin unscaled: no yarn attention factor
        compress = {**compress, "rope_type": "yarn", "attention_factor": 1.0}
    else:
        compress = None
    return V4Config(
        head_dim=head_dim, rope_dim=rope_dim, q_lora_rank=int(cfg["q_lora_rank"]),
        o_groups=groups, o_lora_rank=int(cfg["o_lora_rank"]),
        window=int(cfg.get("sliding_window") or 128), layer_types=types, compress_rates=rates,
        index_heads=int(cfg.get("index_n_heads", 64)),
        index_head_dim=int(cfg.get("index_head_dim", 128)),
        index_topk=int(cfg.get("index_topk", 512)),
        compress_rope_theta=theta, compress_rope_scaling=compress,
        hc_mult=int(cfg.get("hc_mult", 4)), hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(cfg.get("hc_eps", 1e-6)), hash_layers=hashed,
        swiglu_limit=float(cfg.get("swiglu_limit", 0.0) or 0.0))
