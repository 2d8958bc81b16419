"""DeepSeek-V4 (sliding + compressed sparse attention, hyper-connections, hash MoE):
greedy float32 output identical to transformers fed token by token, on tiny checkpoints
of several shapes, under every engine variant; causality; the routing; the cache groups.
"""

from __future__ import annotations

import json

import pytest
import torch

from pdmesh.shared.engine import LLM
from pdmesh.shared.engine.kv_cache_spec import cache_spec
from pdmesh.shared.engine.sampling_params import SamplingParams as Params
from pdmesh.shared.models.config import CSA, HCA, SLIDING, ModelConfig
from pdmesh.shared.models.tiny import DeepSeekV4Shape, make_tiny_model
from tests.shared.engine.hf_reference import assert_greedy_twice, hf_greedy_stepwise

NEW_TOKENS = 24
_g = torch.Generator().manual_seed(78)
_base = torch.randint(10, 4000, (50,), generator=_g).tolist()
PROMPTS = [
    torch.randint(10, 4000, (3,), generator=_g).tolist(),
    _base + torch.randint(10, 4000, (7,), generator=_g).tolist(),  # ends mid-block
    _base + torch.randint(10, 4000, (21,), generator=_g).tolist(),
    torch.randint(10, 4000, (301,), generator=_g).tolist(),
]
SHAPES = {
    # window 16, CSA rate 4 (top-8 of up to 75 entries), HCA rate 16 (= block), yarn,
    # one hash layer, sqrtsoftplus routing
    "default": DeepSeekV4Shape(),
    # window 24, CSA rate 8, HCA rate 32 (an entry per two blocks), two hash layers, a
    # swiglu limit that clips, no yarn (softmax scoring, which transformers' DeepSeek-V4
    # lacks, is checked against the float64 reference in the kernel conformance suite)
    "wide_rates_clamped": DeepSeekV4Shape(window=24, layer_types="chsc", csa_rate=8,
                                          hca_rate=32, index_topk=4, num_hash_layers=2,
                                          swiglu_limit=0.05, yarn=False,
                                          num_nextn_predict_layers=0),
    # HCA first, window 12, sigmoid routing, no hash layer, two streams, 5 Sinkhorn steps
    "hca_first_sigmoid": DeepSeekV4Shape(window=12, layer_types="hcs", csa_rate=4,
                                         hca_rate=8, index_topk=6, num_hash_layers=0,
                                         scoring_func="sigmoid", hc_mult=2,
                                         hc_sinkhorn_iters=5),
}
VARIANTS = {
    "default": {},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "chunked_prefill_odd": {"max_num_batched_tokens": 37},
    "preemption": {"num_kv_blocks": 30},
    "block_size_8": {"block_size": 8},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory, dsv4_tokenizer):
    root = tmp_path_factory.mktemp("deepseek_v4")
    return {name: make_tiny_model(root / name, "deepseek_v4", seed=i, tokenizer=dsv4_tokenizer,
                                  deepseek_v4=shape)
            for i, (name, shape) in enumerate(SHAPES.items())}


@pytest.fixture(scope="module")
def references(models):
    import transformers

    transformers.logging.set_verbosity_error()  # (the MTP layers: "unexpected keys")
    return {name: hf_greedy_stepwise(path, PROMPTS, NEW_TOKENS) for name, path in models.items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_matches_transformers(models, references, shape, variant):
    kwargs = {"block_size": 16, **VARIANTS[variant]}
    llm = LLM(str(models[shape]), device="cpu", dtype="float32", **kwargs)
    outs = assert_greedy_twice(llm, PROMPTS, references[shape], NEW_TOKENS)
    if variant == "preemption":
        assert llm.engine.scheduler.preemptions > 0
    if variant in ("default", "block_size_8"):
        # prompts ending mid-block and mid-compression-window continue from a warm cache
        assert sum(o.num_cached_tokens for o in outs) > 0


def test_logits_never_depend_on_later_tokens(models):
    """One-shot prefill of a prompt and of its prefixes: every position's logits agree
    (the indexer's top-k among entries of later windows included)."""
    llm = LLM(str(models["default"]), device="cpu", dtype="float32", block_size=16,
              enable_prefix_caching=False)
    engine = llm.engine
    prompt = PROMPTS[3][:200]

    def every_logit(tokens: list[int]) -> torch.Tensor:
        req = engine.add_request(tokens, Params(temperature=0.0, max_tokens=1))
        step = engine.scheduler.schedule()
        assert step.requests == [req] and step.num_tokens == [len(tokens)]
        logits, _ = engine.runner.execute(step, every_row=True)
        engine.abort(req.request_id)
        return logits

    whole = every_logit(prompt)
    assert whole.shape[0] == len(prompt)
    for n in (5, 37, 64, 101, 150):
        part = every_logit(prompt[:n])
        torch.testing.assert_close(part, whole[:n], rtol=0, atol=1e-4)
    free, total = engine.kv.usage()["window"]
    assert free == total


def test_the_cache_groups(models):
    """A compressed history group (entries and indexer keys, an entry's slot per rate
    tokens) and a sliding window group (window K=V, compressor inputs) that gives its
    blocks back once the window has passed them."""
    llm = LLM(str(models["default"]), device="cpu", dtype="float32", block_size=16)
    engine = llm.engine
    shape = SHAPES["default"]
    spec = engine.cache_spec
    assert [g.name for g in spec.groups] == ["compressed", "window"]
    history = spec.groups[0]
    roles = sorted((t.layer, t.role, t.slots) for t in history.tensors)
    assert roles == [(1, "entries", 4), (1, "index_keys", 4), (2, "entries", 1),
                     (3, "entries", 4), (3, "index_keys", 4)]
    # per token of context: CSA's entry + indexer key every 4 tokens, HCA's every 16
    d, ih = shape.head_dim, shape.index_head_dim
    per_token = 4 * (2 * (d + ih) / 4 + d / 16)
    assert engine.cache_spec.bytes_per_token(torch.float32) == per_token
    assert engine.kv_bytes_per_token == round(per_token)
    assert spec.groups[1].window == max(shape.window - 1, 2 * 4 - 1, 16 - 1)
    # one long request: the window group keeps only what its window needs
    params = Params(temperature=0.0, max_tokens=40, ignore_eos=True)
    req = engine.add_request(PROMPTS[3], params)
    window_blocks = []
    while engine.has_unfinished():
        engine.step()
        if not req.is_finished:
            held = [b for b in engine.kv.block_ids(req, 1) if b]
            window_blocks.append(len(held))
            # the history covers what was computed: all but the token just sampled
            assert len(engine.kv.block_ids(req, 0)) == -(-(req.num_tokens - 1) // 16)
    assert max(window_blocks[1:]) <= -(-spec.groups[1].window // 16) + 1
    assert all(free == total for free, total in engine.kv.usage().values())


def test_config_spellings_agree_and_mismatches_are_refused(models, tmp_path):
    path = models["wide_rates_clamped"]
    raw = json.loads((path / "config.json").read_text())
    both = ModelConfig.from_dict(raw).v4
    official = {k: v for k, v in raw.items() if k not in ("layer_types", "compress_rates")}
    official["compress_ratios"] = [4, 128, 0, 4]  # DeepSeek's: 4 is CSA, others HCA
    v4 = ModelConfig.from_dict(official).v4
    assert v4.layer_types == (CSA, HCA, SLIDING, CSA) and v4.compress_rates == (4, 128, 0, 4)
    assert both.layer_types == (CSA, HCA, SLIDING, CSA) and both.compress_rates == (8, 32, 0, 8)
    hf = {k: v for k, v in raw.items() if k not in ("compress_ratios", "num_hash_layers")}
    hf["mlp_layer_types"] = ["hash_moe", "hash_moe", "moe", "moe"]
    assert ModelConfig.from_dict(hf).v4 == both
    with pytest.raises(ValueError, match="compress_ratios and layer_types"):
        ModelConfig.from_dict({**raw, "compress_ratios": [4, 4, 0, 4, 0]})
    with pytest.raises(ValueError, match="n_shared_experts"):
        ModelConfig.from_dict({**raw, "n_shared_experts": 2})
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_dict({**raw, "layer_types": ["full_attention"] * 4})
    with pytest.raises(ValueError, match="o_groups"):
        ModelConfig.from_dict({**raw, "o_groups": 3})
    with pytest.raises(ValueError, match="block_size: 12"):
        cache_spec(ModelConfig.from_dict(raw), 12)


def test_mtp_layers_load_apart(models):
    llm = LLM(str(models["default"]), device="cpu", dtype="float32", block_size=16)
    w = llm.engine.model.w
    assert len(w.layers) == llm.engine.model_config.num_layers == 4
    assert len(w.mtp) == 1
    m = w.mtp[0]
    hidden = llm.engine.model_config.hidden_size
    assert m.e_proj.shape == m.h_proj.shape == (hidden, hidden)
    assert m.layer.attn.compressor is None and m.layer.mlp.tid2eid is None
    assert m.layer.mlp.correction_bias is not None  # a learned router, not a hash layer
    assert LLM(str(models["wide_rates_clamped"]), device="cpu", dtype="float32",
               block_size=16).engine.model.w.mtp == []


@pytest.mark.parametrize("shape", ["default", "wide_rates_clamped", "hca_first_sigmoid"])
def test_routing_matches_transformers_routers(models, shape):
    """Hash layers (experts by token id, weights from the router's scores) and learned
    top-k (sqrtsoftplus / sigmoid plus correction bias), per layer, against
    transformers' own router modules loaded with the same weights."""
    from transformers import AutoModelForCausalLM

    path = models[shape]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16)
    model = llm.engine.model
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, model.config.hidden_size, generator=g)
    ids = torch.randint(0, model.config.vocab_size, (64,), generator=g)
    hashed = 0
    for i, layer in enumerate(model.w.layers):
        gate = hf.model.layers[i].mlp.gate
        if layer.mlp.tid2eid is not None:
            hashed += 1
            _, want_w, want_ids = gate(x, ids)
        else:
            _, want_w, want_ids = gate(x)
        got_w, got_ids = model.route(layer.mlp, x, ids)
        order_g, order_w = got_ids.sort(-1), want_ids.sort(-1)
        assert torch.equal(order_g.values, order_w.values), f"layer {i}"
        torch.testing.assert_close(got_w.gather(1, order_g.indices),
                                   want_w.gather(1, order_w.indices), rtol=1e-5, atol=1e-6)
    assert hashed == SHAPES[shape].num_hash_layers


@pytest.mark.parametrize("layout", ["save_pretrained", "state_dict"])
def test_a_checkpoint_in_transformers_layout_gives_the_official_layout_s_tokens(
        models, tmp_path, layout):
    """A fine-tune written by transformers - save_pretrained (DeepSeek's names under
    ``model.``, ``model.embed_tokens``, ``attn.norm`` for the attention's kv_norm), or its
    state dict as such (``self_attn.q_a_proj``, ``mlp.experts.gate_up_proj`` fused, ...) -
    loads under DeepSeek's names and gives the official layout's greedy tokens; its
    hyper-connection ``.scale`` tensors are not mistaken for quantization scales."""
    import shutil

    import transformers
    from safetensors.torch import save_file

    from pdmesh.shared.models.checkpoint import open_checkpoint

    transformers.logging.set_verbosity_error()
    path = models["default"]  # (a hash layer, CSA and HCA, MTP layers transformers drops)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = tmp_path / layout
    if layout == "save_pretrained":
        hf.save_pretrained(out)
    else:
        out.mkdir()
        save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
                  str(out / "model.safetensors"))
        hf.config.save_pretrained(out)
    for f in path.glob("tokenizer*"):
        shutil.copy(f, out)
    with open_checkpoint(out) as ckpt:
        names = ckpt.names()
    assert "model.embed_tokens.weight" in names
    assert any(".experts.gate_up_proj" in n for n in names) == (layout == "state_dict")
    sp = Params(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    want = LLM(str(path), device="cpu", dtype="float32", block_size=16).generate(PROMPTS, sp)
    got = LLM(str(out), device="cpu", dtype="float32", block_size=16).generate(PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
