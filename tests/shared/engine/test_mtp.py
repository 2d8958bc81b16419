"""DeepSeek MTP speculation (the checkpoint's MTP layer as the proposer): greedy output
token-identical to decoding one token a step, under chunked prefill, preemption and
prefix caching; the MTP layer's own KV, built a chunk and a verified step at a time and
written ahead by chained drafts, gives the drafts a from-scratch computation gives; the
dynamic verify budget; the distilled head gets accepted."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.engine.spec_decode import (
    Drafts,
    DynamicBudget,
    SpeculativeConfig,
    VerifyBudget,
)
from pdmesh.shared.engine.structured import json_schema_grammar, regex_grammar
from pdmesh.shared.models.tiny import make_tiny_model
from tests.shared.engine.spec_runs import (
    assert_hand_back_exact,
    assert_no_block_held,
    mixed_prompts,
    run,
)


def mtp(k: int | None, method: str = "deepseek_mtp") -> dict:
    """(Every step drafts k: test_draft_length.py tests how many drafts pay.)"""
    spec = {"method": method, "adaptive_drafts": False}
    if k is not None:
        spec["num_speculative_tokens"] = k
    return spec


@pytest.fixture(scope="module")
def ds3(tiny_models):
    return tiny_models["deepseek_v3"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, bpe_tokenizer):
    """A tiny DeepSeek-V3 whose MTP layer was distilled (briefly) from the model."""
    from pdmesh.shared.training.mtp import MtpTraining, train_mtp

    path = make_tiny_model(tmp_path_factory.mktemp("mtp") / "ds3", "deepseek_v3", seed=3,
                           tokenizer=bpe_tokenizer)
    # (the first draft only, chain=False: half the time; measured here, 9 drafts accepted
    # against 8 with the chained loss, the random head's 0)
    before, after = train_mtp(path, MtpTraining(prompts=48, new_tokens=64, steps=200,
                                                batch=8, seed=3, chain=False))
    return path, before, after


@pytest.fixture(scope="module")
def reference(trained):
    path = trained[0]
    ps = mixed_prompts(12)
    params = [SamplingParams(temperature=0, max_tokens=20 + 4 * (i % 4), ignore_eos=True)
              for i in range(len(ps))]
    return path, ps, params, run(path, ps, params)[0]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_is_token_identical(reference, k):
    path, ps, params, want = reference
    got, llm = run(path, ps, params, speculative_config=mtp(k))
    assert got == want
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert len(stats.accepted_per_position) == k
    assert_no_block_held(llm)


def test_identical_under_chunked_prefill_preemption_and_prefix_caching(reference):
    """Few KV blocks (requests preempted and recomputed, MTP KV with them), prompt
    chunks of 24 tokens, prompts that share prefixes."""
    path, ps, params, want = reference
    shared = [ps[0][:40] + p for p in ps[:4]]
    ref_shared = run(path, shared, params[:4])[0]
    got, llm = run(path, ps + shared, params + params[:4], speculative_config=mtp(3),
                   num_kv_blocks=14, max_num_batched_tokens=24, max_num_seqs=8)
    assert got == want + ref_shared
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert_no_block_held(llm)


def test_a_verify_budget_of_one_verifies_one_draft_and_keeps_the_output(reference):
    """dflash with a budget of one draft per request (its confidences never reach the
    threshold, so it stays there): three drafts proposed, one verified, output exact."""
    path, ps, params, want = reference
    budget = DynamicBudget(initial_verify_budget_per_req=1, budget_update_interval=4,
                           budget_threshold=0.999, min_verify_tokens=1)
    got, llm = run(path, ps, params,
                   speculative_config=SpeculativeConfig("mtp", 3, adaptive=False, dynamic=budget))
    assert got == want
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens == stats.num_drafts
    assert llm.engine.verify_budget.budget == 1
    assert_no_block_held(llm)


@pytest.mark.parametrize("arch,prompt", [("deepseek_v3", 50), ("deepseek_v4", 70)])
def test_mtp_kv_built_step_by_step_drafts_as_a_fresh_computation(tiny_models, arch, prompt):
    """A request prefilled in chunks, then decoding with verified drafts (random heads:
    nearly all rejected, so the chained drafts' KV is written ahead and overwritten each
    step), drafts what an engine computing the MTP layer over the whole sequence at once
    drafts, with the same confidences. (DeepSeek-V4: its MTP block's window K=V, the
    prompt past the sliding window of 16.)"""
    budget = DynamicBudget(initial_verify_budget_per_req=3, min_verify_tokens=3)
    spec = SpeculativeConfig("mtp", 3, adaptive=False, dynamic=budget)
    model = str(tiny_models[arch])
    stepped = LLM(model, device="cpu", block_size=16, dtype="float32",
                  max_num_batched_tokens=16, speculative_config=spec).engine
    req = stepped.add_request(list(range(100, 100 + prompt)),
                              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while req.num_output_tokens < 12:
        stepped.step()
    assert stepped.spec_stats.num_drafts >= 3  # it verified drafts on the way
    assert req.drafts is not None and len(req.drafts.tokens) == 3
    assert_drafts_as_a_fresh_engine(model, spec, req)


def assert_drafts_as_a_fresh_engine(model: str, spec: SpeculativeConfig, req) -> None:
    """``req``'s drafts (and their confidences) are those of an engine that computes the
    MTP layers over its whole sequence at once."""
    fresh = LLM(model, device="cpu", block_size=16, dtype="float32",
                enable_prefix_caching=False, speculative_config=spec).engine
    # its prompt: all but the newest token, which it samples itself (greedy: the same)
    again = fresh.add_request(req.token_ids[:-1],
                              SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    fresh.step()
    assert again.token_ids == req.token_ids
    assert again.drafts.tokens == req.drafts.tokens
    assert again.drafts.confidence == pytest.approx(req.drafts.confidence, rel=1e-4,
                                                    abs=1e-6)


def test_the_distilled_head_is_accepted(trained, reference, tmp_path, bpe_tokenizer):
    path, before, after = trained
    assert after > before + 0.1
    _, ps, params, _ = reference
    rate = run(path, ps, params, speculative_config=mtp(1))[1].engine.spec_stats
    untrained = make_tiny_model(tmp_path / "ds3", "deepseek_v3", seed=3,
                                tokenizer=bpe_tokenizer)
    base = run(untrained, ps, params, speculative_config=mtp(1))[1].engine.spec_stats
    print(f"acceptance: distilled {rate.acceptance_rate:.2f}, random "
          f"{base.acceptance_rate:.2f}")
    # (a brief distillation; `make-tiny-model --train-mtp` trains longer)
    assert rate.num_accepted_tokens > 3 * base.num_accepted_tokens + 5


def test_chained_distillation_writes_back_only_the_mtp_layer(tmp_path, bpe_tokenizer):
    """train_mtp with the chained drafts' loss too (`make-tiny-model --train-mtp`'s):
    a few steps change the MTP layer's weights alone, and the model still drafts."""
    from safetensors.torch import load_file

    from pdmesh.shared.training.mtp import MtpTraining, train_mtp

    path = make_tiny_model(tmp_path / "ds3", "deepseek_v3", seed=4, tokenizer=bpe_tokenizer)
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    before = load_file(str(path / "model.safetensors"))
    train_mtp(path, MtpTraining(prompts=8, new_tokens=16, steps=4, batch=4, seed=4,
                                chain=True))
    after = load_file(str(path / "model.safetensors"))
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed and all(k.startswith(f"model.layers.{layers}.") for k in changed), changed
    got, llm = run(path, [[40, 41, 42, 43]], SamplingParams(temperature=0, max_tokens=8,
                                                          ignore_eos=True),
                   speculative_config=mtp(2))
    assert len(got[0]) == 8 and llm.engine.spec_stats.num_drafts > 0


OBJECT = {"type": "object", "required": ["name", "n"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999}}}


@pytest.mark.parametrize("grammar,check", [
    (regex_grammar("[^aeiou]*"), lambda o: not set(o.text) & set("aeiou")),  # (or a prefix)
    (json_schema_grammar(OBJECT), lambda o: o.finish_reason == "stop"
     and jsonschema.validate(json.loads(o.text), OBJECT) is None)])
def test_a_grammar_masks_every_verified_position(reference, grammar, check):
    """The MTP head drafts unconstrained (its q unmasked), the target is masked at each
    verified position: greedy output token-identical to one token a step, with drafts
    kept; sampled output (the drafts' q in the acceptance test) obeys the grammar."""
    path, ps, _, _ = reference

    def outputs(params, **engine):
        llm = LLM(str(path), device="cpu", block_size=16, **engine)
        return [o.outputs[0] for o in llm.generate(ps, params)], llm

    greedy = SamplingParams(temperature=0, max_tokens=48, grammar=grammar)
    want = outputs(greedy)[0]
    got, llm = outputs(greedy, speculative_config=mtp(2))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=48, grammar=grammar)
    got, llm = outputs(sampled, speculative_config=mtp(2))
    assert llm.engine.spec_stats.num_drafts > 0
    for o in got + want:
        assert o.finish_reason != "error" and check(o), (o.finish_reason, o.text)
    assert_no_block_held(llm)


def test_config_as_vllm_reads_it(ds3, qwen3_path):
    spec = SpeculativeConfig.from_dict(mtp(None, "mtp"))
    assert spec.is_mtp and spec.num_speculative_tokens is None
    llm = LLM(str(ds3), device="cpu", block_size=16, speculative_config=spec)
    # k defaults to the checkpoint's MTP layers; their KV is one more layer in the cache
    assert llm.engine.speculative.num_speculative_tokens == 1
    assert ";" not in llm.engine.cache_spec.layout()
    assert f"{llm.engine.model_config.num_layers}.latent" in llm.engine.cache_spec.layout()
    with pytest.raises(ValueError, match="speculative_config.method: mtp needs the "
                                         "checkpoint's MTP layers"):
        LLM(str(qwen3_path), device="cpu", speculative_config=mtp(1))
    with pytest.raises(ValueError, match="dynamic_spec_config.method: dspark needs a draft "
                                         "model with a confidence head"):
        LLM(str(ds3), device="cpu", speculative_config=SpeculativeConfig(
            "mtp", 2, dynamic=DynamicBudget(method="dspark")))
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        SpeculativeConfig.from_dict(mtp(0))


def test_the_verify_budget_goes_to_the_surest_drafts():
    cfg = DynamicBudget(initial_verify_budget_per_req=2, budget_update_interval=2,
                        budget_threshold=0.5, min_verify_tokens=1)
    budget = VerifyBudget(cfg, 4)
    sure = Drafts([1, 2, 3, 4], confidence=[0.99, 0.98, 0.97, 0.9])
    unsure = Drafts([5, 6, 7, 8], confidence=[0.3, 0.9, 0.9, 0.9])
    # 2 per request on average: the sure request takes 3, the unsure one its minimum
    cut = budget.apply([sure, unsure])
    assert [d.tokens for d in cut] == [[1, 2, 3], [5]]
    assert cut[0].confidence == [0.99, 0.98, 0.97]
    # after budget_update_interval steps: cells surviving >= 0.5 per request, rounded up
    # (4 + 0 over two steps of two requests each: 8 / 4 = 2, even and < k: 3)
    budget.apply([sure, unsure])
    assert budget.budget == 3
    low = VerifyBudget(DynamicBudget(initial_verify_budget_per_req=9, min_verify_tokens=0), 3)
    assert low.budget == 3  # clamped to k
    assert [d.tokens for d in low.apply([Drafts([1], confidence=[0.1])])] == [[1]]


def test_trained_attention_goes_back_in_the_checkpoints_form(ds3):
    """The inverse of the loader's MLA and MLP transforms: a layer read and written back
    is the checkpoint's, tensor for tensor."""
    from safetensors.torch import load_file

    from pdmesh.shared.training.trainable import mla_checkpoint, mlp_checkpoint

    llm = LLM(str(ds3), device="cpu", dtype="float32", block_size=16)
    cfg = llm.engine.model_config
    stored = load_file(str(ds3 / "model.safetensors"))
    for i, w in ((1, llm.engine.model.w.layers[1].attn),
                 (cfg.num_layers, llm.engine.model.w.mtp[0].layer.attn)):
        written = mla_checkpoint(cfg, w)
        assert set(written) == {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight",
                                "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight",
                                "kv_b_proj.weight", "o_proj.weight"}
        for key, x in written.items():
            assert torch.equal(x, stored[f"model.layers.{i}.self_attn.{key}"]), (i, key)
    for i, w in ((0, llm.engine.model.w.layers[0].mlp),  # dense
                 (cfg.num_layers, llm.engine.model.w.mtp[0].layer.mlp)):  # experts + shared
        written = mlp_checkpoint(w, stored, f"model.layers.{i}.mlp.")
        assert written and all(torch.equal(x, stored[key]) for key, x in written.items())
    assert f"model.layers.{cfg.num_layers}.mlp.experts.0.down_proj.weight" in written


def test_the_training_forward_is_the_engines_mlp(ds3):
    """The distillation trains through ``training.mlp_forward``; it computes what the
    engine's ``CausalLM._mlp`` does, for a dense layer and for routed plus shared experts."""
    from pdmesh.shared.training.trainable import mlp_forward

    llm = LLM(str(ds3), device="cpu", dtype="float32", block_size=16)
    model = llm.engine.model
    x = torch.randn(37, llm.engine.model_config.hidden_size,
                    generator=torch.Generator().manual_seed(0))
    for w, layer in ((model.w.layers[0].mlp, 0), (model.w.mtp[0].layer.mlp, None)):
        want = model._mlp(w, x.clone(), layer)
        got = mlp_forward(model, w, x.clone())
        assert got.shape == want.shape and not torch.equal(got, torch.zeros_like(got))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_recompute_hand_back_with_mtp_drafts_keeps_every_output_exact(tiny_models, arch):
    """vLLM-Ascend's recompute scheduler on a decode engine drafting with MTP: a request
    that must give its blocks up (its MTP KV with them) is handed back; what each request
    produced until then is the start of its greedy answer, and no block stays held."""
    path = tiny_models[arch]
    ps = mixed_prompts(10, seed=4, longest=70)
    params = [SamplingParams(temperature=0, max_tokens=24 + 4 * (i % 3), ignore_eos=True)
              for i in range(len(ps))]
    want = run(path, ps, params, dtype="float32")[0]
    llm = LLM(str(path), device="cpu", block_size=16, dtype="float32", num_kv_blocks=20,
              recompute_scheduler=True, speculative_config=mtp(2))
    assert_hand_back_exact(llm, ps, params, want)


def test_two_mtp_layers_draft_in_turn_each_over_its_own_kv(tmp_path, bpe_tokenizer):
    """A checkpoint with two MTP layers: draft j comes from layer j % 2 (vLLM's pick);
    every position runs through both layers' KV, so the drafts (layer 1's among them)
    are those of an engine computing both over the whole sequence at once, confidences
    and all; the greedy output is the target's alone."""
    from pdmesh.shared.models.tiny import DeepSeekShape

    model = str(make_tiny_model(tmp_path / "ds3x2", "deepseek_v3", seed=5,
                                tokenizer=bpe_tokenizer,
                                deepseek=DeepSeekShape(num_nextn_predict_layers=2)))
    budget = DynamicBudget(initial_verify_budget_per_req=3, min_verify_tokens=3)
    spec = SpeculativeConfig("mtp", 3, adaptive=False, dynamic=budget)
    stepped = LLM(model, device="cpu", block_size=16, dtype="float32",
                  max_num_batched_tokens=16, speculative_config=spec).engine
    assert len(stepped.proposer.caches) == 2
    forward = stepped.model.mtp_forward
    picked: list[tuple[int, int]] = []  # (layer, rows whose logits were asked)

    def spy(index, *args):
        picked.append((index, int(args[-1].shape[0])))
        return forward(index, *args)

    stepped.model.mtp_forward = spy
    req = stepped.add_request(list(range(100, 150)),
                              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while req.num_output_tokens < 12:
        stepped.step()
    assert stepped.spec_stats.num_drafts >= 3
    # each drafting step: layer 1's KV (no drafts asked), layer 0 (draft 1); then the
    # chain, every position through both layers: layer 1 gives draft 2, layer 0 draft 3
    assert [(i, n > 0) for i, n in picked[-6:]] == [
        (1, False), (0, True), (0, False), (1, True), (1, False), (0, True)], picked
    assert_drafts_as_a_fresh_engine(model, spec, req)
    ps = mixed_prompts(4)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True) for _ in ps]
    assert run(model, ps, params, speculative_config=mtp(3))[0] == run(model, ps, params)[0]
