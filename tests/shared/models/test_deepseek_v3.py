"""DeepSeek-V3 (MLA, DeepSeekMoE, MTP layers): greedy float32 output identical to
transformers on tiny checkpoints of several shapes, the latent KV cache, the routing."""

from __future__ import annotations

import pytest
import torch

from pdmesh.shared.engine import LLM
from pdmesh.shared.kernels import get_backend
from pdmesh.shared.models.config import ModelConfig
from pdmesh.shared.models.tiny import DeepSeekShape, make_tiny_model
from tests.shared.engine.hf_reference import assert_greedy_twice, hf_greedy

NEW_TOKENS = 24
_g = torch.Generator().manual_seed(77)
_base = torch.randint(10, 4000, (50,), generator=_g).tolist()
PROMPTS = [
    torch.randint(10, 4000, (3,), generator=_g).tolist(),
    _base + torch.randint(10, 4000, (7,), generator=_g).tolist(),
    _base + torch.randint(10, 4000, (21,), generator=_g).tolist(),
    torch.randint(10, 4000, (301,), generator=_g).tolist(),
]
SHAPES = {
    "q_lora_grouped": DeepSeekShape(),
    "no_q_lora_ungrouped": DeepSeekShape(q_lora_rank=None, n_group=1, topk_group=1),
    "yarn_two_dense_layers": DeepSeekShape(yarn=True, first_k_dense_replace=2,
                                           kv_lora_rank=48, qk_rope_head_dim=8,
                                           num_nextn_predict_layers=0),
}
VARIANTS = {
    "default": {},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "chunked_prefill_odd": {"max_num_batched_tokens": 37},
    "preemption": {"num_kv_blocks": 30},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory, bpe_tokenizer):
    root = tmp_path_factory.mktemp("deepseek")
    return {name: make_tiny_model(root / name, "deepseek_v3", seed=i, tokenizer=bpe_tokenizer,
                                  deepseek=shape)
            for i, (name, shape) in enumerate(SHAPES.items())}


@pytest.fixture(scope="module")
def references(models):
    import transformers

    transformers.logging.set_verbosity_error()  # (the MTP layers: "unexpected keys")
    return {name: hf_greedy(path, PROMPTS, NEW_TOKENS) for name, path in models.items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_matches_transformers(models, references, shape, variant):
    llm = LLM(str(models[shape]), device="cpu", dtype="float32", block_size=16,
              **VARIANTS[variant])
    outs = assert_greedy_twice(llm, PROMPTS, references[shape], NEW_TOKENS)
    if variant == "preemption":
        assert llm.engine.scheduler.preemptions > 0
    if variant == "default":
        assert sum(o.num_cached_tokens for o in outs) > 0


def test_the_cache_holds_the_latent_only(models):
    """One latent "head" of kv_lora_rank + rope dims per token and layer, not per-head K/V."""
    llm = LLM(str(models["q_lora_grouped"]), device="cpu", dtype="float32", block_size=16)
    cfg, shape = llm.engine.model_config, SHAPES["q_lora_grouped"]
    latent = shape.kv_lora_rank + shape.qk_rope_head_dim
    assert llm.engine.kv_bytes_per_token == cfg.num_layers * latent * 4
    per_head_kv = cfg.num_layers * cfg.num_heads * (
        shape.qk_nope_head_dim + shape.qk_rope_head_dim + shape.v_head_dim) * 4
    assert llm.engine.kv_bytes_per_token * 4 < per_head_kv
    caches = llm.engine.runner.kv_caches
    assert len(caches) == cfg.num_layers and all(len(layer) == 1 for layer in caches)
    assert caches[0]["latent"].shape[1:] == (16, 1, latent)


def test_mtp_layers_load_and_are_not_decoder_layers(models):
    llm = LLM(str(models["q_lora_grouped"]), device="cpu", dtype="float32", block_size=16)
    cfg = llm.engine.model_config
    assert cfg.num_nextn_predict_layers == 1 and len(llm.engine.model.w.layers) == cfg.num_layers
    mtp = llm.engine.model.w.mtp
    assert len(mtp) == 1
    hidden = cfg.hidden_size
    assert mtp[0].eh_proj.shape == (2 * hidden, hidden)
    assert mtp[0].head.shape == (hidden, cfg.vocab_size)
    assert mtp[0].embed is llm.engine.model.w.embed  # shared, as DeepSeek-V3 has it
    assert mtp[0].layer.attn.w_uk.shape[0] == cfg.num_heads  # a whole MLA decoder layer
    # a checkpoint that declares none loads without any
    none = LLM(str(models["yarn_two_dense_layers"]), device="cpu", dtype="float32")
    assert none.engine.model.w.mtp == []


def test_config_reads_the_official_fields(models):
    cfg = ModelConfig.from_folder(models["yarn_two_dense_layers"])
    assert cfg.mla is not None and cfg.mla.q_lora_rank == 96 and cfg.mla.latent_dim == 56
    assert cfg.moe.scoring == "sigmoid" and cfg.moe.num_groups == 4 and cfg.moe.topk_groups == 2
    assert cfg.moe.routed_scaling == 2.5 and cfg.moe.num_shared_experts == 1
    assert [cfg.moe.is_moe_layer(i) for i in range(cfg.num_layers)] == [False, False, True, True]
    mscale = 0.1 * 0.707 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert cfg.mla.softmax_scale == pytest.approx((32 + 8) ** -0.5 * mscale ** 2)


@pytest.mark.parametrize("groups", [(1, 1), (4, 2), (8, 3)])
def test_grouped_top_k_routing_equals_the_reference(groups):
    """moe_gating_grouped_topk against transformers' DeepseekV3TopkRouter."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    n_group, topk_group = groups
    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4,
                           n_group=n_group, topk_group=topk_group, norm_topk_prob=True,
                           routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(sum(groups))
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.1)
    x = torch.randn(64, 32, generator=g)
    _, ref_w, ref_ids = router(x)
    be = get_backend("cpu")
    w, ids = be.moe_gating_grouped_topk(x @ router.weight.detach().t(), 4, n_group, topk_group,
                                        router.e_score_correction_bias, True, 2.5)
    ref_order, order = ref_ids.sort(dim=-1), ids.sort(dim=-1)
    assert torch.equal(order.values, ref_order.values)
    assert torch.allclose(w.gather(1, order.indices), ref_w.gather(1, ref_order.indices),
                          atol=1e-6)
    if n_group > 1:  # every chosen expert lies in one of the topk_group best groups
        assert max(len(set(row)) for row in (ids // (16 // n_group)).tolist()) <= topk_group
