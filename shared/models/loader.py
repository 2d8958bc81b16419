"""Load a Hugging Face-style model folder: config.json + *.safetensors (memory-mapped).

Checkpoint names are Hugging Face's. Experts come either one per tensor
(``mlp.experts.{e}.gate_proj.weight``, real checkpoints) or already stacked
(``mlp.experts.gate_up_proj``, as newer transformers releases write them).
DeepSeek-V4 checkpoints keep DeepSeek's own names (``layers.{i}.attn.wq_a``, ...), as
its official releases ship them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pdmesh.shared.kernels import KernelBackend
from pdmesh.shared.kernels.quant import QuantExperts, QuantLinear
from pdmesh.shared.models import quantization, v4_layout
from pdmesh.shared.models.checkpoint import CheckpointReader, open_checkpoint
from pdmesh.shared.models.config import CSA, SLIDING, ModelConfig, local_config
from pdmesh.shared.models.deepseek_v4 import (
    CompressorWeights,
    DeepseekV4,
    HyperConnectionWeights,
    V4AttentionWeights,
    V4LayerWeights,
    V4MtpWeights,
    V4Weights,
)
from pdmesh.shared.models.quantization import QTensor
from pdmesh.shared.models.transformer import (
    AttentionWeights,
    CausalLM,
    DenseMLPWeights,
    LayerWeights,
    MLAWeights,
    ModelWeights,
    MoEWeights,
    MtpWeights,
)
from pdmesh.shared.parallel.finegrained_tp import FineGrainedLayout
from pdmesh.shared.parallel.tensor_parallel import Shard, TensorParallel

log = logging.getLogger(__name__)


def check_tensor_parallel(folder: str | Path, size: int,
                          quantization_flag: str | None = None, experts: bool = True) -> None:
    """ValueError (naming tensor_parallel_size) for a model that cannot run on ``size``
    ranks: heads or widths it does not divide (``experts``: the routed experts' too),
    DeepSeek-V4, quantized weights; checked before any rank starts (config and headers
    only, no weight read)."""
    config = ModelConfig.from_folder(folder)
    for rank in (0, size - 1):
        local_config(config, Shard(rank, size, experts))
    if config.v4 is None:
        with open_checkpoint(folder) as ckpt:
            quantized = quantization.plan(folder, ckpt.dtypes(), quantization_flag)
        static = _static_w8a8(quantized, ("o_proj.weight", "down_proj.weight"))
        if static:
            raise ValueError(f"tensor_parallel_size: static W8A8 weights split by their "
                             f"input ({static[0]}, ...) fold their whole input into "
                             "quant_bias; use W8A8_DYNAMIC or W4A8_DYNAMIC with TP")


def load_model(
    folder: str | Path, backend: KernelBackend, dtype: torch.dtype,
    config: ModelConfig | None = None, quantization_flag: str | None = None,
    dequantize: bool = False, shard: Shard | None = None,
    fine: FineGrainedLayout | None = None,
) -> tuple[ModelConfig, CausalLM | DeepseekV4]:
    """Read config (unless given) and weights; weights land on the backend's device in
    ``dtype``. ``quantization_flag``: --quantization; ``dequantize``: quantized weights
    read as the floats they stand for (the reference the quantized model is measured
    against); ``shard``: one tensor-parallel rank's slices (the model's own ``config``
    is then that rank's, the one returned the whole model's); ``fine``: the modules
    fine-grained TP splits over DP ranks (this rank reads its slices of them)."""
    config = config or ModelConfig.from_folder(folder)
    dev = backend.device
    with open_checkpoint(folder) as ckpt:
        ckpt.quant = quantization.plan(folder, ckpt.dtypes(), quantization_flag)
        ckpt.dequantize = dequantize
        if ckpt.quant is not None:
            log.info("model: %s: %s%s", folder, ckpt.quant.describe(),
                     " (read as floats)" if dequantize else "")
        if fine is not None and ckpt.quant is not None:
            _check_fine_static(fine, ckpt.quant)
        ckpt.fine = fine
        if shard is None and config.v4 is not None:
            v4 = _prepared(_read_v4(config, ckpt, dtype, dev), backend)
            return config, DeepseekV4(config, v4, backend)
        if shard is None:
            weights = _prepared(_read_weights(config, ckpt, dtype, dev), backend)
            return config, CausalLM(config, weights, backend)
        local = local_config(config, shard)
        ckpt.shard = shard
        ckpt.q_heads = shard.part(config.num_heads, "num_attention_heads")
        ckpt.kv_heads = shard.kv_heads(config.num_kv_heads)
        start, rows = shard.vocab(config.vocab_size)
        ckpt.vocab = slice(start, start + rows)
        model: CausalLM | DeepseekV4
        if config.v4 is not None:
            model = DeepseekV4(local, _prepared(_read_v4(local, ckpt, dtype, dev), backend),
                               backend)
        else:
            model = CausalLM(local, _prepared(_read_weights(local, ckpt, dtype, dev), backend),
                             backend)
    model.tp = TensorParallel(shard, config.vocab_size)
    return config, model


def _static_w8a8(quant: quantization.QuantPlan | None, suffixes: tuple[str, ...]
                 ) -> list[str]:
    """The static W8A8 weights whose names end so (those split by their input: their
    quant_bias folds the whole input's zero point), sorted."""
    return sorted(n for n, t in (quant.types.items() if quant else ())
                  if t == "w8a8" and n.endswith(suffixes))


def _check_fine_static(fine: FineGrainedLayout, quant: quantization.QuantPlan) -> None:
    """Static W8A8 weights fine-grained TP would split by their input (o_proj, a dense
    MLP's down_proj) are refused naming the key, as tensor parallelism refuses them."""
    splits = {"oproj": "o_proj.weight", "mlp": "mlp.down_proj.weight"}
    for module, suffix in splits.items():
        if fine.shard(module) is None:
            continue
        static = _static_w8a8(quant, (suffix,))
        if static:
            raise ValueError(f"finegrained_tp_config.{module}_tensor_parallel_size: static "
                             f"W8A8 weights split by their input ({static[0]}, ...) fold "
                             "their whole input into quant_bias; use W8A8_DYNAMIC or "
                             "W4A8_DYNAMIC with fine-grained TP")


def _o_b_columns(ckpt: CheckpointReader, name: str, groups: slice) -> slice:
    """DeepSeek-V4's wo_b input columns a rank reads: a tensor-parallel rank's groups',
    fine-grained TP's share of them (oproj), or all."""
    oproj = ckpt.fine.shard("oproj") if ckpt.fine is not None else None
    if oproj is None:
        return groups
    return oproj.part(ckpt.shape(name)[1], name + " columns")


def _rows(fine: FineGrainedLayout, module: str, n: int) -> slice:
    """This rank's vocabulary rows of a module fine-grained TP splits (all otherwise)."""
    shard = fine.shard(module)
    if shard is None:
        return slice(None)
    start, rows = shard.vocab(n)
    return slice(start, start + rows)


def _prepared(obj, backend: KernelBackend):
    """Every quantized weight in the weights' dataclasses as the backend computes it
    (``KernelBackend.prepare``), in place."""
    if isinstance(obj, list):
        for i, item in enumerate(obj):
            obj[i] = _prepared(item, backend)
    elif isinstance(obj, QuantLinear | QuantExperts):
        return backend.prepare(obj)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            value = getattr(obj, name)
            if isinstance(value, list | QuantLinear | QuantExperts) or hasattr(
                    value, "__dataclass_fields__"):
                setattr(obj, name, _prepared(value, backend))
    return obj


def _read_weights(
    cfg: ModelConfig, ckpt: CheckpointReader, dtype: torch.dtype, dev: torch.device
) -> ModelWeights:
    def get(name: str) -> torch.Tensor | QTensor:
        return ckpt.get(name, dtype, dev)

    # (a tensor-parallel rank: its vocabulary rows of both; fine-grained TP: its rows of
    # the one it splits)
    fine = ckpt.fine
    embed_rows = lm_rows = ckpt.vocab
    if fine is not None:
        embed_rows = _rows(fine, "embedding", cfg.vocab_size)
        lm_rows = _rows(fine, "lmhead", cfg.vocab_size)
    embed = (ckpt.dense("model.embed_tokens.weight", dtype, dev) if embed_rows == slice(None)
             else ckpt.part("model.embed_tokens.weight", dtype, dev, 0, embed_rows))
    head = ("lm_head.weight" if ckpt.has("lm_head.weight") and not cfg.tie_word_embeddings
            else "model.embed_tokens.weight")
    if head == "model.embed_tokens.weight" and lm_rows == embed_rows:
        lm_head = embed.t()
    elif lm_rows == slice(None):
        lm_head = _input_major(get(head))
    else:
        lm_head = _input_major(ckpt.part(head, dtype, dev, 0, lm_rows))
    layers = [_read_layer(cfg, ckpt, i, dtype, dev) for i in range(cfg.num_layers)]
    # (MTP layers run as a proposer: a tensor-parallel rank holds its shard of them too)
    mtp = [_read_mtp_layer(cfg, ckpt, cfg.num_layers + i, embed, lm_head, dtype, dev)
           for i in range(cfg.num_nextn_predict_layers)
           if ckpt.has(f"model.layers.{cfg.num_layers + i}.eh_proj.weight")]
    return ModelWeights(embed=embed, layers=layers, final_norm=get("model.norm.weight"),
                        lm_head=lm_head, mtp=mtp)


def _read_mtp_layer(cfg: ModelConfig, ckpt: CheckpointReader, i: int, embed: torch.Tensor,
                    lm_head: torch.Tensor, dtype: torch.dtype, dev: torch.device
                    ) -> MtpWeights:
    """DeepSeek-V3's MTP layer ``model.layers.{num_hidden_layers + k}``: its norms,
    eh_proj, shared_head and a decoder layer (MoE, as the layers past
    first_k_dense_replace). The embedding is the model's (DeepSeek-V3 shares it; the
    copy a checkpoint carries is not read), the head its own where it has one."""
    p = f"model.layers.{i}."

    def get(name: str) -> torch.Tensor | QTensor:
        return ckpt.get(p + name, dtype, dev)

    return MtpWeights(
        enorm=get("enorm.weight"), hnorm=get("hnorm.weight"),
        eh_proj=_input_major(get("eh_proj.weight")), layer=_read_layer(cfg, ckpt, i, dtype, dev),
        head_norm=get("shared_head.norm.weight"),
        head=_input_major(ckpt.part(p + "shared_head.head.weight", dtype, dev, 0, ckpt.vocab))
        if ckpt.has(p + "shared_head.head.weight") else lm_head,  # (TP: its vocabulary rows)
        embed=embed)


def _input_major(w: torch.Tensor | QTensor) -> torch.Tensor | QuantLinear | QuantExperts:
    """nn.Linear's [out, in] (or stacked [E, out, in]) -> contiguous [in, out], float or
    quantized."""
    return quantization.kernel(w)


def _read_layer(
    cfg: ModelConfig, ckpt: CheckpointReader, i: int, dtype: torch.dtype, dev: torch.device
) -> LayerWeights:
    p = f"model.layers.{i}."

    def get(name: str) -> torch.Tensor | QTensor:
        return ckpt.get(p + name, dtype, dev)

    oproj = ckpt.fine.shard("oproj") if ckpt.fine is not None else None
    o_columns = None  # fine-grained o_proj: this rank's input columns (head slices)
    if oproj is not None:
        name = p + "self_attn.o_proj.weight"
        o_columns = oproj.part(ckpt.shape(name)[1], name + " columns")
    attn = _read_mla(cfg, ckpt, p, dtype, dev, o_columns) if cfg.mla else _read_attention(
        cfg, ckpt, p, i, dtype, dev, o_columns)
    mlp: DenseMLPWeights | MoEWeights
    if cfg.moe is not None and cfg.moe.is_moe_layer(i):
        mlp = _read_experts(cfg, ckpt, p, dtype, dev)
    else:
        fine = ckpt.fine.shard("mlp") if ckpt.fine is not None else None
        mlp = _read_dense(ckpt, p + "mlp.", dtype, dev, fine or ckpt.shard)
    return LayerWeights(
        input_norm=get("input_layernorm.weight"),
        post_attn_norm=get("post_attention_layernorm.weight"),
        attn=attn,
        mlp=mlp,
    )


def _read_dense(ckpt: CheckpointReader, p: str, dtype: torch.dtype,
                dev: torch.device, shard: Shard | None = None) -> DenseMLPWeights:
    """``shard``: the slice this rank holds (tensor-parallel, or fine-grained TP's)."""
    if shard is not None:  # gate | up by rows of the intermediate size, down by columns
        inner = shard.part(ckpt.shape(p + "gate_proj.weight")[0], p + "intermediate size")
        return DenseMLPWeights(
            gate_up=_input_major(quantization.cat([ckpt.part(p + f"{n}_proj.weight", dtype,
                                                             dev, 0, inner)
                                                   for n in ("gate", "up")], dtype)),
            down=_input_major(ckpt.part(p + "down_proj.weight", dtype, dev, 1, inner)))
    gate_up = quantization.cat([ckpt.get(p + "gate_proj.weight", dtype, dev),
                                ckpt.get(p + "up_proj.weight", dtype, dev)], dtype)
    return DenseMLPWeights(gate_up=_input_major(gate_up),
                           down=_input_major(ckpt.get(p + "down_proj.weight", dtype, dev)))


def mla_rows(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint rows, in the loader's order, of the q projection (all heads) and of
    kv_a_proj_with_mqa: rotary dims stored interleaved (rope_interleave) are taken even
    dims first, then odd (rotate-half order); every other row keeps its place."""
    m = cfg.mla
    assert m is not None
    h, nope, rope, lat = cfg.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    order = (torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
             if m.rope_interleave else torch.arange(rope))
    q_rows = torch.cat([torch.cat((torch.arange(nope), nope + order)) + j * (nope + rope)
                        for j in range(h)])
    return q_rows, torch.cat((torch.arange(lat), lat + order))


def _read_mla(cfg: ModelConfig, ckpt: CheckpointReader, p: str, dtype: torch.dtype,
              dev: torch.device, o_columns: slice | None = None) -> MLAWeights:
    """DeepSeek's latent attention. Rotary dims stored interleaved (rope_interleave) are
    put in rotate-half order here, in the q and kv_a projections alike: every dot
    product is the same, and the rotary kernel is the one the other models use.
    ``o_columns``: the input columns of o_proj this rank holds (fine-grained TP)."""
    m = cfg.mla
    assert m is not None
    h, nope, lat = cfg.num_heads, m.qk_nope_head_dim, m.kv_lora_rank

    def get(name: str) -> torch.Tensor | QTensor:
        return ckpt.get(p + "self_attn." + name, dtype, dev)

    def heads(name: str, per_head: int, dim: int) -> torch.Tensor:
        """A tensor-parallel rank's query heads of a weight (all heads otherwise)."""
        hs = ckpt.q_heads
        if ckpt.shard is None:
            return get(name)  # type: ignore[return-value]
        return ckpt.part(p + "self_attn." + name, dtype, dev, dim,
                         slice(hs.start * per_head, hs.stop * per_head))

    qk = nope + m.qk_rope_head_dim
    q_rows, kv_rows = mla_rows(cfg)  # (cfg: this rank's heads)
    if m.q_lora_rank is None:
        q, q_a, q_a_norm, q_b = _input_major(heads("q_proj.weight", qk, 0)[q_rows]), None, \
            None, None
    else:
        q, q_a = None, _input_major(get("q_a_proj.weight"))
        q_a_norm = ckpt.dense(p + "self_attn.q_a_layernorm.weight", dtype, dev)
        q_b = _input_major(heads("q_b_proj.weight", qk, 0)[q_rows])
    kv_b = (ckpt.dense(p + "self_attn.kv_b_proj.weight", dtype, dev) if ckpt.shard is None
            else quantization.dense(heads("kv_b_proj.weight", nope + m.v_head_dim, 0),
                                    dtype))  # absorbed: floats
    expected = (h * (nope + m.v_head_dim), lat)
    if tuple(kv_b.shape) != expected:
        raise ValueError(f"model: {p}self_attn.kv_b_proj has shape {tuple(kv_b.shape)}, "
                         f"expected {expected}")
    kv_b = kv_b.view(h, nope + m.v_head_dim, lat)
    return MLAWeights(
        q=q, q_a=q_a, q_a_norm=q_a_norm, q_b=q_b,
        kv_a=_input_major(get("kv_a_proj_with_mqa.weight")[kv_rows]),
        kv_a_norm=ckpt.dense(p + "self_attn.kv_a_layernorm.weight", dtype, dev),
        w_uk=kv_b[:, :nope].contiguous(),  # [H, nope, L]
        w_uv=kv_b[:, nope:].transpose(1, 2).contiguous(),  # [H, L, v]
        o=_input_major(heads("o_proj.weight", m.v_head_dim, 1) if o_columns is None else
                       ckpt.part(p + "self_attn.o_proj.weight", dtype, dev, 1, o_columns)))


def _read_attention(cfg: ModelConfig, ckpt: CheckpointReader, p: str, i: int,
                    dtype: torch.dtype, dev: torch.device, o_columns: slice | None = None
                    ) -> AttentionWeights:
    """``o_columns``: the input columns of o_proj this rank holds (fine-grained TP)."""
    d = cfg.head_dim
    # a tensor-parallel rank's rows: its query heads of q (and o's columns), its K / V
    # heads of k and v
    rows = {n: slice(hs.start * d, hs.stop * d) if hs != slice(None) else hs
            for n, hs in (("q", ckpt.q_heads), ("k", ckpt.kv_heads), ("v", ckpt.kv_heads))}

    def get(name: str, dim: int = 0, part: slice = slice(None)) -> torch.Tensor | QTensor:
        return ckpt.part(p + name, dtype, dev, dim, part) if ckpt.shard is not None else \
            ckpt.get(p + name, dtype, dev)

    def maybe(name: str, part: slice) -> torch.Tensor | None:
        return get(name, 0, part) if ckpt.has(p + name) else None  # type: ignore[return-value]

    qkv = quantization.cat([get(f"self_attn.{n}_proj.weight", 0, rows[n]) for n in "qkv"],
                           dtype)
    biases = [maybe(f"self_attn.{n}_proj.bias", rows[n]) for n in "qkv"]
    if cfg.qkv_bias and any(b is None for b in biases):
        raise ValueError(f"model: layer {i} lacks q/k/v biases that {cfg.architecture} needs")
    qkv_bias = torch.cat(biases, dim=0) if all(b is not None for b in biases) else None  # type: ignore[arg-type]
    if isinstance(qkv, QTensor) and qkv.scheme == "w8a8":
        qkv_bias = None  # static W8A8 folds the bias into quant_bias (vLLM-Ascend adds none)
    qk_norm = None
    if cfg.qk_norm:
        qk_norm = torch.cat([ckpt.dense(p + "self_attn.q_norm.weight", dtype, dev).expand(
            cfg.num_heads, -1), ckpt.dense(p + "self_attn.k_norm.weight", dtype, dev).expand(
            cfg.num_kv_heads, -1)])
    return AttentionWeights(qkv=_input_major(qkv), qkv_bias=qkv_bias,
                            o=_input_major(get("self_attn.o_proj.weight", 1, rows["q"])
                                           if o_columns is None else
                                           ckpt.part(p + "self_attn.o_proj.weight", dtype,
                                                     dev, 1, o_columns)),
                            qk_norm=qk_norm)


def _read_experts(
    cfg: ModelConfig, ckpt: CheckpointReader, p: str, dtype: torch.dtype, dev: torch.device
) -> MoEWeights:
    assert cfg.moe is not None
    router = ckpt.dense(p + "mlp.gate.weight", dtype, dev)
    inner = slice(None)  # a tensor-parallel rank: every expert's share of its width
    split = ckpt.shard is not None and ckpt.shard.experts  # (EP: experts whole)
    if split:
        inner = ckpt.shard.part(cfg.moe.intermediate_size * ckpt.shard.size,
                                "moe_intermediate_size")
    if ckpt.has(p + "mlp.experts.gate_up_proj") and split:
        full = cfg.moe.intermediate_size * ckpt.shard.size
        stacked = p + "mlp.experts.gate_up_proj"
        w13 = torch.cat([ckpt.part(stacked, dtype, dev, 1, inner), ckpt.part(
            stacked, dtype, dev, 1, slice(full + inner.start, full + inner.stop))], dim=1)
        w2 = ckpt.part(p + "mlp.experts.down_proj", dtype, dev, 2, inner)
    elif ckpt.has(p + "mlp.experts.gate_up_proj"):
        w13 = ckpt.dense(p + "mlp.experts.gate_up_proj", dtype, dev)
        w2 = ckpt.dense(p + "mlp.experts.down_proj", dtype, dev)
    else:
        e = p + "mlp.experts.{}.{}_proj.weight"

        def expert(j: int, n: str, dim: int) -> torch.Tensor | QTensor:
            return ckpt.part(e.format(j, n), dtype, dev, dim, inner) if split else \
                ckpt.get(e.format(j, n), dtype, dev)

        w13 = quantization.stack([
            quantization.cat([expert(j, "gate", 0), expert(j, "up", 0)], dtype)
            for j in range(cfg.moe.num_experts)
        ], dtype)
        w2 = quantization.stack([expert(j, "down", 1) for j in range(cfg.moe.num_experts)],
                                dtype)
    expected = (cfg.moe.num_experts, 2 * cfg.moe.intermediate_size, cfg.hidden_size)
    if tuple(w13.shape) != expected:
        raise ValueError(f"model: {p}mlp.experts gate/up has shape {tuple(w13.shape)}, "
                         f"expected {expected}")
    shared = None
    if cfg.moe.num_shared_experts:  # (tensor-parallel unless enable_shared_expert_dp)
        shared = _read_dense(ckpt, p + "mlp.shared_experts.", dtype, dev,
                             ckpt.shard if ckpt.shard is not None and ckpt.shard.shared
                             else None)
    bias = ckpt.maybe(p + "mlp.gate.e_score_correction_bias", torch.float32, dev)
    if cfg.moe.scoring == "sigmoid" and bias is None:
        raise ValueError(f"model: {p}mlp.gate.e_score_correction_bias is missing "
                         f"({cfg.architecture} routes with it)")
    return MoEWeights(router=_input_major(router), w13=_input_major(w13), w2=_input_major(w2),
                      correction_bias=bias, shared=shared)


# -- DeepSeek-V4 --------------------------------------------------------------------------
def rope_rows(dim: int, rope: int, copies: int = 1) -> torch.Tensor:
    """Index that puts the last ``rope`` dims of each of ``copies`` ``dim`` vectors side
    by side (heads, halves) from interleaved pairs into rotate-half order (x0, x2, ..,
    x1, x3, ..): DeepSeek-V4's rows, as the loader reorders them."""
    one = torch.cat((torch.arange(dim - rope), dim - rope + torch.arange(0, rope, 2),
                     dim - rope + torch.arange(1, rope, 2)))
    return torch.cat([one + j * dim for j in range(copies)])


def _read_v4(cfg: ModelConfig, ckpt: CheckpointReader, dtype: torch.dtype,
             dev: torch.device) -> V4Weights:
    if v4_layout.is_transformers_layout(ckpt.names()):
        if ckpt.quant is not None:
            raise ValueError("model: a quantized DeepSeek-V4 checkpoint in transformers' "
                             "layout (model.layers.{i}.self_attn...) is not read; quantized "
                             "ones load in DeepSeek's own layout, as modelslim writes them")
        ckpt.read_as(v4_layout.official_names(ckpt.names(), ckpt.shape))

    def f32(name: str) -> torch.Tensor:
        return ckpt.get(name, torch.float32, dev)

    def hc(p: str) -> HyperConnectionWeights:
        return HyperConnectionWeights(fn=f32(p + "_fn").t().contiguous(), base=f32(p + "_base"),
                                      scale=f32(p + "_scale"))

    v4 = cfg.v4
    assert v4 is not None
    layers = [_read_v4_layer(cfg, ckpt, f"layers.{i}.", v4.layer_types[i], v4.compress_rates[i],
                             v4.hash_layers[i], dtype, dev, hc)
              for i in range(cfg.num_layers)]
    # (a tensor-parallel rank: its vocabulary rows of both; fine-grained TP: its rows of
    # the one it splits)
    embed_rows = lm_rows = ckpt.vocab
    if ckpt.fine is not None:
        embed_rows = _rows(ckpt.fine, "embedding", cfg.vocab_size)
        lm_rows = _rows(ckpt.fine, "lmhead", cfg.vocab_size)
    embed = quantization.dense(ckpt.part("embed.weight", dtype, dev, 0, embed_rows), dtype)
    lm_head = _input_major(ckpt.part("head.weight", dtype, dev, 0, lm_rows))
    mtp, not_run = [], None
    for i in range(cfg.num_nextn_predict_layers):
        p = f"mtp.{i}."
        if not ckpt.has(p + "e_proj.weight"):
            break
        if ckpt.has(p + "attn.compressor.wkv.weight"):
            not_run = f"{p[:-1]} has compressed attention"
            break
        mtp.append(V4MtpWeights(
            e_proj=_input_major(ckpt.get(p + "e_proj.weight", dtype, dev)),
            h_proj=_input_major(ckpt.get(p + "h_proj.weight", dtype, dev)),
            enorm=ckpt.get(p + "enorm.weight", dtype, dev),
            hnorm=ckpt.get(p + "hnorm.weight", dtype, dev),
            norm=ckpt.get(p + "norm.weight", dtype, dev), hc_head=hc(p + "hc_head"),
            layer=_read_v4_layer(cfg, ckpt, p, SLIDING, 0, False, dtype, dev, hc),
            embed=quantization.dense(ckpt.part(p + "emb.tok_emb.weight", dtype, dev, 0,
                                               ckpt.vocab), dtype)
            if ckpt.has(p + "emb.tok_emb.weight") else embed,
            head=_input_major(ckpt.part(p + "head.weight", dtype, dev, 0, ckpt.vocab))
            if ckpt.has(p + "head.weight") else lm_head))
    return V4Weights(embed=embed, layers=layers, final_norm=ckpt.get("norm.weight", dtype, dev),
                     lm_head=lm_head, hc_head=hc("hc_head"), mtp=mtp, mtp_not_run=not_run)


def _read_v4_layer(cfg: ModelConfig, ckpt: CheckpointReader, p: str, kind: str, rate: int,
                   hashed: bool, dtype: torch.dtype, dev: torch.device, hc) -> V4LayerWeights:
    """The V4 layer under prefix ``p`` (``layers.{i}.``, or an MTP block's ``mtp.{i}.``:
    sliding-window attention, learned router)."""
    v4, moe = cfg.v4, cfg.moe
    assert v4 is not None and moe is not None
    a = p + "attn."
    h, d, r = cfg.num_heads, v4.head_dim, v4.rope_dim

    def get(name: str) -> torch.Tensor | QTensor:
        return ckpt.get(name, dtype, dev)

    head_order = rope_rows(d, r)
    # a tensor-parallel rank: its query heads (``cfg`` is its own: h of them), its groups
    # of the grouped output projection, its share of each expert's width
    h0 = ckpt.q_heads.start or 0
    q_rows = rope_rows(d, r, h)  # within this rank's heads
    q_heads = slice(None) if ckpt.shard is None else slice(h0 * d, (h0 + h) * d)
    shard = ckpt.shard

    def compressor(c: str, dim: int, rate: int, overlap: bool
                   ) -> tuple[CompressorWeights, torch.Tensor]:
        halves = 2 if overlap else 1
        order = rope_rows(dim, r, halves)
        proj = quantization.cat([get(c + "wkv.weight")[order], get(c + "wgate.weight")[order]],
                                dtype)
        ape = ckpt.get(c + "ape", torch.float32, dev)
        if tuple(ape.shape) != (rate, halves * dim):
            raise ValueError(f"model: {c}ape has shape {tuple(ape.shape)}, expected "
                             f"{(rate, halves * dim)} (compress rate {rate})")
        return (CompressorWeights(rate=rate, overlap=overlap, dim=dim, ape=ape[:, order],
                                  norm=ckpt.dense(c + "norm.weight", dtype, dev)[
                                      rope_rows(dim, r)]), proj)

    parts = [get(a + "wq_a.weight"), get(a + "wkv.weight")[head_order]]
    comp = index_comp = index_q = None
    if rate:
        comp, proj = compressor(a + "compressor.", d, rate, kind == CSA)
        parts.append(proj)
    if kind == CSA:
        ih = v4.index_head_dim
        index_comp, proj = compressor(a + "indexer.compressor.", ih, rate, True)
        parts.append(proj)
        parts.append(get(a + "indexer.weights_proj.weight"))
        rows = rope_rows(ih, r, v4.index_heads)
        index_q = _input_major(get(a + "indexer.wq_b.weight")[rows])
    g = v4.o_groups
    groups = slice(shard.rank * g * v4.o_lora_rank, (shard.rank + 1) * g * v4.o_lora_rank) \
        if shard is not None else slice(None)
    # [groups * o_lora, H * D / groups]: this rank's groups, read as such
    o_a = quantization.dense(ckpt.part(a + "wo_a.weight", dtype, dev, 0, groups), dtype)
    expected = (g * v4.o_lora_rank, h * d // g)
    if tuple(o_a.shape) != expected:
        raise ValueError(f"model: {a}wo_a has shape {tuple(o_a.shape)}, expected {expected}")
    in_order = rope_rows(d, r, h // g)
    o_a = o_a[:, in_order].view(g, v4.o_lora_rank, -1).transpose(1, 2).contiguous()
    attn = V4AttentionWeights(
        x_proj=_input_major(quantization.cat(parts, dtype)),
        splits=tuple(t.shape[0] for t in parts), q_a_norm=get(a + "q_norm.weight"),
        q_b=_input_major(ckpt.part(a + "wq_b.weight", dtype, dev, 0, q_heads)[q_rows]),
        kv_norm=ckpt.dense(a + "kv_norm.weight", dtype, dev)[head_order], o_a=o_a,
        o_b=_input_major(ckpt.part(a + "wo_b.weight", dtype, dev, 1, _o_b_columns(
            ckpt, a + "wo_b.weight", groups))),
        sinks=ckpt.part(a + "attn_sink", torch.float32, dev, 0, ckpt.q_heads),
        compressor=comp,
        index_q=index_q, index_compressor=index_comp)
    f = p + "ffn."
    e = f + "experts.{}.{}.weight"

    def width(name: str, along: int, split: bool) -> torch.Tensor | QTensor:
        """An expert weight, or this rank's share of its intermediate width (``along``:
        the weight's dimension that is: 0 for w1 / w3, 1 for w2)."""
        if not split:
            return get(name)
        inner = shard.part(ckpt.shape(name)[along], name + " width")
        return ckpt.part(name, dtype, dev, along, inner)

    split = shard is not None and shard.experts
    w13 = quantization.stack([quantization.cat([width(e.format(j, "w1"), 0, split),
                                                width(e.format(j, "w3"), 0, split)], dtype)
                              for j in range(moe.num_experts)], dtype)
    w2 = quantization.stack([width(e.format(j, "w2"), 1, split)
                             for j in range(moe.num_experts)], dtype)
    expected = (moe.num_experts, 2 * moe.intermediate_size, cfg.hidden_size)
    if tuple(w13.shape) != expected:
        raise ValueError(f"model: {f}experts w1/w3 have shape {tuple(w13.shape)}, "
                         f"expected {expected}")
    split = shard is not None and shard.shared
    shared = DenseMLPWeights(
        gate_up=_input_major(quantization.cat([width(f + "shared_experts.w1.weight", 0, split),
                                               width(f + "shared_experts.w3.weight", 0, split)],
                                              dtype)),
        down=_input_major(width(f + "shared_experts.w2.weight", 1, split)))
    tid2eid = bias = None
    if hashed:
        tid2eid = ckpt.get(f + "gate.tid2eid", torch.int64, dev)
        if (tuple(tid2eid.shape) != (cfg.vocab_size, moe.top_k)
                or int(tid2eid.min()) < 0 or int(tid2eid.max()) >= moe.num_experts):
            raise ValueError(f"model: {f}gate.tid2eid must be [vocab, num_experts_per_tok] "
                             f"expert ids below {moe.num_experts}")
    else:
        bias = ckpt.get(f + "gate.bias", torch.float32, dev)
    mlp = MoEWeights(router=_input_major(ckpt.dense(f + "gate.weight", dtype, dev)),
                     w13=_input_major(w13),
                     w2=_input_major(w2), correction_bias=bias, shared=shared, tid2eid=tid2eid)
    return V4LayerWeights(
        attn_norm=get(p + "attn_norm.weight"), ffn_norm=get(p + "ffn_norm.weight"),
        attn_hc=hc(p + "hc_attn"), ffn_hc=hc(p + "hc_ffn"), attn=attn, mlp=mlp)
