"""LoRA adapters on DeepSeek-V4: every projection PEFT can target (the attention's, the
compressors' and the indexer's, fused in pdmesh's x_proj, and the shared experts'),
greedy float32 output token-identical to transformers + PEFT for a batch mixing three
adapters with the base model; DeepSeek's own module names read as transformers'; an
adapter's prompt never meets the base model's cached blocks in any cache group; what
cannot run is refused naming the module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdmesh.shared.engine import LLM, LoRARequest, SamplingParams
from tests.shared.engine.lora_reference import make_adapters, peft_greedy
from tests.shared.engine.test_lora import check_quantized_base, write_adapter

NEW = 10
_g = torch.Generator().manual_seed(44)
# long enough to close CSA (rate 4) and HCA (rate 16) windows past the window (16)
PROMPTS = [torch.randint(10, 4000, (n,), generator=_g).tolist() for n in (45, 9, 70)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def v4(tiny_models):
    return tiny_models["deepseek_v4"]


@pytest.fixture(scope="module")
def adapters(v4, tmp_path_factory):
    """Three PEFT adapters of the tiny DeepSeek-V4: ranks 4, 8 (rsLoRA) and 2."""
    import transformers

    transformers.logging.set_verbosity_error()  # (the MTP layers: "unexpected keys")
    shapes = [(4, 8.0, False), (8, 16.0, True), (2, 2.0, False)]
    return make_adapters(v4, tmp_path_factory.mktemp("v4-adapters"), "deepseek_v4", shapes,
                         seed=12)


@pytest.fixture(scope="module")
def llm(v4):
    return LLM(str(v4), device="cpu", dtype="float32", block_size=16, enable_lora=True,
               max_loras=3, max_lora_rank=8)


def lora(i: int, path: Path) -> LoRARequest:
    return LoRARequest(f"v4-{i}", i + 1, str(path))


def test_a_batch_mixing_three_adapters_and_the_base_matches_peft(v4, adapters, llm):
    """Three adapters and the base model in one batch, token for token PEFT's over
    transformers' DeepSeek-V4 (fed token by token); each adapter tells."""
    jobs = [(0, PROMPTS[0]), (None, PROMPTS[1]), (1, PROMPTS[2]), (2, PROMPTS[0]),
            (None, PROMPTS[0]), (1, PROMPTS[1])]
    expected = peft_greedy(v4, adapters, jobs, NEW, stepwise=True)
    assert len({json.dumps(expected[k]) for k in (0, 3, 4)}) == 3
    outs = llm.generate([p for _, p in jobs], GREEDY, lora_request=[
        None if i is None else lora(i, adapters[i]) for i, _ in jobs])
    assert [o.outputs[0].token_ids for o in outs] == expected
    for name, (free, total) in llm.engine.kv.usage().items():
        assert free == total, f"{name}: {total - free} blocks leaked"


def test_deepseek_s_own_module_names_are_read_alike(adapters, llm, tmp_path):
    """An adapter naming DeepSeek's modules (layers.{i}.attn.wq_a, compressor.wkv,
    ffn.shared_experts.w1 ...) is the same adapter as under transformers' names."""
    renames = [("model.layers.", "layers."),
               (".self_attn.compressor.indexer.scorer.weights_proj",
                ".attn.indexer.weights_proj"),
               (".self_attn.compressor.indexer.q_b_proj", ".attn.indexer.wq_b"),
               (".self_attn.compressor.indexer.", ".attn.indexer.compressor."),
               (".self_attn.", ".attn."),
               (".mlp.shared_experts.gate_proj", ".ffn.shared_experts.w1"),
               (".mlp.shared_experts.up_proj", ".ffn.shared_experts.w3"),
               (".mlp.shared_experts.down_proj", ".ffn.shared_experts.w2"),
               ("q_a_proj", "wq_a"), ("q_b_proj", "wq_b"), ("kv_proj", "wkv"),
               ("gate_proj", "wgate"), ("o_b_proj", "wo_b")]
    folder = tmp_path / "deepseek-names"
    folder.mkdir()
    (folder / "adapter_config.json").write_text((adapters[0] / "adapter_config.json").read_text())
    tensors = {}
    for key, t in load_file(str(adapters[0] / "adapter_model.safetensors")).items():
        for a, b in renames:
            key = key.replace(a, b)
        tensors[key] = t
    assert "base_model.model.layers.1.attn.indexer.compressor.wgate.lora_A.weight" in tensors
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    outs = llm.generate(PROMPTS * 2, GREEDY, lora_request=[lora(0, adapters[0])] * 3
                        + [LoRARequest("deepseek-names", 9, str(folder))] * 3)
    got = [o.outputs[0].token_ids for o in outs]
    assert got[:3] == got[3:]


def test_an_adapter_s_prompt_never_meets_the_base_model_s_blocks(adapters, llm):
    """The same prompt run by the base model, then by an adapter: the adapter's finds
    nothing cached (no cache group's block is shared); its second run finds its own."""
    prompt = PROMPTS[2]
    llm.generate([prompt], GREEDY)
    first = llm.generate([prompt], GREEDY, lora_request=lora(2, adapters[2]))[0]
    again = llm.generate([prompt], GREEDY, lora_request=lora(2, adapters[2]))[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens >= 64
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize(("module", "shape", "words"), [
    ("model.layers.1.self_attn.o_a_proj", (64, 256), "grouped output projection"),
    ("layers.1.attn.wo_a", (64, 256), "grouped output projection"),
    ("model.layers.0.self_attn.compressor.kv_proj", (128, 256),
     "layer 0 has no compressor.kv"),
    ("model.layers.2.self_attn.compressor.indexer.q_b_proj", (256, 64),
     "layer 2 has no indexer"),
    ("model.layers.1.mlp.experts.gate_up_proj", (8, 8), "routed experts"),
    ("model.layers.1.self_attn.kv_proj", (65, 256), "the model's module is [64, 256]"),
])
def test_what_a_v4_adapter_cannot_target_is_refused_naming_it(llm, tmp_path, module, shape,
                                                              words):
    out, inp = shape
    folder = write_adapter(tmp_path / "bad", {module: (torch.zeros(4, inp),
                                                       torch.zeros(out, 4))}, 4, 8.0)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("bad", 7, str(folder)))
    for name, (free, total) in llm.engine.kv.usage().items():
        assert free == total, f"{name}: {total - free} blocks leaked"


def test_an_adapter_on_a_w8a8_base(v4, adapters, tmp_path):
    """Over W8A8 (dynamic) projections, x_proj's included: the adapter's logits and what
    it adds to them agree with the same adapter over the dequantized weights. (The
    adapter on all 14 projections of every layer moves the activations W8A8 quantizes
    per token: the cosine measured 0.995 with it, 0.9994 without; what it adds, 0.997.)"""
    check_quantized_base(v4, adapters[1], tmp_path, "w8a8_dynamic", 0.99)
