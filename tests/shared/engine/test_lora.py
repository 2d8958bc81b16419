"""LoRA adapters in the engine: greedy float32 output token-identical to transformers +
PEFT for each adapter and for batches mixing adapters with the base model, on every
architecture LoRA runs on; dense and shared-expert MLP adapters against merged weights;
an adapter's prompt never meets the base model's cached blocks; what cannot run is
refused naming the key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdmesh.shared.engine import LLM, EngineConfig, LoRARequest, SamplingParams
from tests.shared.engine.hf_reference import hf_greedy
from tests.shared.engine.lora_reference import make_adapters, peft_greedy

NEW = 10
PROMPTS = [list(range(100, 121)), list(range(300, 307)), list(range(2000, 2040))]
ARCHS = ["llama", "qwen3", "qwen3_moe", "deepseek_v3"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    """arch -> three PEFT adapters of its tiny model: ranks 4, 8 (rsLoRA) and 2."""
    root = tmp_path_factory.mktemp("adapters")
    shapes = [(4, 8.0, False), (8, 16.0, True), (2, 2.0, False)]
    return {arch: make_adapters(tiny_models[arch], root / arch, arch, shapes, seed=10)
            for arch in ARCHS}


def lora(i: int, path: Path) -> LoRARequest:
    return LoRARequest(f"adapter-{i}", i + 1, str(path))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_batch_mixing_three_adapters_and_the_base_matches_peft(tiny_models, adapters,
                                                                 arch):
    """Three adapters and the base model in one batch (three slots: every row's adapter
    runs in the same forward), token for token PEFT's; the same prompt under two
    adapters and the base gives three texts."""
    base, paths = tiny_models[arch], adapters[arch]
    jobs = [(0, PROMPTS[0]), (None, PROMPTS[1]), (1, PROMPTS[2]), (2, PROMPTS[0]),
            (None, PROMPTS[0])]
    expected = peft_greedy(base, paths, jobs, NEW)
    assert len({json.dumps(expected[k]) for k in (0, 3, 4)}) == 3  # each adapter tells
    llm = LLM(str(base), device="cpu", dtype="float32", block_size=16, enable_lora=True,
              max_loras=3, max_lora_rank=8)
    outs = llm.generate([p for _, p in jobs], GREEDY, lora_request=[
        None if i is None else lora(i, paths[i]) for i, _ in jobs])
    assert [o.outputs[0].token_ids for o in outs] == expected
    # one adapter alone, not in the first slot: the step reads that slot's weights only
    assert llm.engine.lora.slots.slot_of("adapter-2") != 0
    again = llm.generate([PROMPTS[0]], GREEDY, lora_request=lora(2, paths[2]))
    assert again[0].outputs[0].token_ids == expected[3]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_one_slot_runs_three_adapters_in_turn(tiny_models, adapters, monkeypatch):
    """max_loras 1: a step runs one adapter; requests of the others wait (the base
    model's go by) and the slot is reloaded, the text unchanged."""
    base, paths = tiny_models["qwen3"], adapters["qwen3"]
    llm = LLM(str(base), device="cpu", dtype="float32", block_size=16, enable_lora=True,
              max_loras=1, max_cpu_loras=2, max_lora_rank=8)
    alone = [llm.generate(PROMPTS[:2], GREEDY, lora_request=lora(i, p))
             for i, p in enumerate(paths)]
    seen: list[set[str]] = []
    step = llm.engine.lora.step

    def counted(rows, device):
        seen.append({n for n in rows if n is not None})
        return step(rows, device)

    monkeypatch.setattr(llm.engine.lora, "step", counted)
    requests = [lora(i, p) for i, p in enumerate(paths) for _ in PROMPTS[:2]] + [None, None]
    outs = llm.generate(PROMPTS[:2] * 3 + PROMPTS[:2], GREEDY, lora_request=requests)
    for i in range(3):
        got = [o.outputs[0].token_ids for o in outs[2 * i:2 * i + 2]]
        assert got == [o.outputs[0].token_ids for o in alone[i]]
    assert max(len(s) for s in seen) == 1 and len(set().union(*seen)) == 3


def test_an_adapter_s_prompt_never_meets_the_base_model_s_blocks(tiny_models, adapters):
    base, path = tiny_models["llama"], adapters["llama"][0]
    llm = LLM(str(base), device="cpu", dtype="float32", block_size=16, enable_lora=True,
              max_lora_rank=8)
    prompt = [list(range(500, 548))]
    first = llm.generate(prompt, GREEDY)[0]
    with_adapter = llm.generate(prompt, GREEDY, lora_request=lora(0, path))[0]
    again = llm.generate(prompt, GREEDY, lora_request=lora(0, path))[0]
    other = llm.generate(prompt, GREEDY, lora_request=lora(1, adapters["llama"][1]))[0]
    base_again = llm.generate(prompt, GREEDY)[0]
    assert first.num_cached_tokens == 0 and with_adapter.num_cached_tokens == 0
    assert other.num_cached_tokens == 0
    assert again.num_cached_tokens == base_again.num_cached_tokens >= 32
    assert again.outputs[0].token_ids == with_adapter.outputs[0].token_ids
    # the pool's keys chain from the same roots: an adapter's never equal the base's
    kv = llm.engine.kv
    engine = llm.engine
    root = kv.hasher.root_for(f"lora:{engine.lora.load(lora(0, path)).digest}")
    assert root != kv.hasher.root and root != kv.hasher.root_for("lora:other")


def write_adapter(folder: Path, modules: dict[str, tuple[torch.Tensor, torch.Tensor]],
                  r: int, alpha: float, **config) -> Path:
    """A PEFT-format adapter written by hand: module -> (lora_A [r, in], lora_B [out, r])."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "bias": "none",
         "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}), **config}))
    tensors = {}
    for module, (a, b) in modules.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_dense_and_shared_expert_mlps_match_merged_weights(tiny_models, tmp_path):
    """DeepSeek-V3's dense layer MLP and a MoE layer's shared experts: the adapter
    equals its update merged into the checkpoint (W + alpha / r * B @ A), run by
    transformers."""
    base = tiny_models["deepseek_v3"]
    weights = load_file(str(base / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    r, alpha = 4, 6.0
    modules = {}
    for module in ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
                   "model.layers.0.mlp.down_proj", "model.layers.2.mlp.shared_experts.up_proj",
                   "model.layers.2.mlp.shared_experts.down_proj"):
        out, inp = weights[module + ".weight"].shape
        modules[module] = (torch.randn(r, inp, generator=gen) * 0.1,
                           torch.randn(out, r, generator=gen) * 0.1)
    adapter = write_adapter(tmp_path / "mlp", modules, r, alpha)
    merged = tmp_path / "merged"
    shutil.copytree(base, merged)
    for module, (a, b) in modules.items():
        weights[module + ".weight"] = weights[module + ".weight"] + alpha / r * b @ a
    save_file(weights, str(merged / "model.safetensors"))
    expected = hf_greedy(merged, PROMPTS, NEW)
    assert expected != hf_greedy(base, PROMPTS, NEW)
    llm = LLM(str(base), device="cpu", dtype="float32", block_size=16, enable_lora=True,
              max_lora_rank=4)
    outs = llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("mlp", 1, str(adapter)))
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.fixture(scope="module")
def qwen3_lora(tiny_models):
    return LLM(str(tiny_models["qwen3"]), device="cpu", dtype="float32", block_size=16,
               enable_lora=True, max_lora_rank=8)


@pytest.mark.parametrize(("config", "module", "words"), [
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save: ['lm_head'] is not supported"),
    ({"bias": "all"}, None, "bias: 'all'"),
    ({"use_dora": True}, None, "use_dora"),
    ({"r": 16}, None, "above --max-lora-rank (8)"),
    ({}, "model.layers.0.mlp.experts.0.gate_proj", "routed experts"),
    ({}, "lm_head", "lm_head: LoRA on this module is not supported"),
])
def test_adapters_pdmesh_cannot_run_are_refused_naming_the_key(qwen3_lora, tmp_path,
                                                                config, module, words):
    r = config.pop("r", 4)
    target = module or "model.layers.0.self_attn.q_proj"
    shape = (64, 64) if module is None else (8, 8)
    folder = write_adapter(tmp_path / "bad", {target: (torch.zeros(r, shape[1]),
                                                       torch.zeros(shape[0], r))},
                           r, 8.0, **config)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)").replace("]", r"\]")):
        qwen3_lora.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("bad", 9,
                                                                          str(folder)))
    assert qwen3_lora.engine.kv.num_free_blocks == qwen3_lora.engine.kv.num_blocks


def test_an_adapter_that_cannot_be_read_is_refused_naming_its_folder(qwen3_lora, adapters,
                                                                     tmp_path):
    """A torn weights file (a copy cut short) is a ValueError naming lora_path, for a
    runtime load as for a request; nothing is left loaded."""
    bad = tmp_path / "torn"
    shutil.copytree(adapters["qwen3"][0], bad)
    weights = bad / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    engine = qwen3_lora.engine
    with pytest.raises(ValueError, match="lora_path: .* cannot be read"):
        engine.load_lora("torn", str(bad))
    with pytest.raises(ValueError, match="lora_path: .* cannot be read"):
        qwen3_lora.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("torn", 3, str(bad)))
    assert "torn" not in engine.lora.names()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("scheme", ["w8a8_dynamic", "w8a8"])
def test_an_adapter_on_a_quantized_base(tiny_models, adapters, tmp_path, scheme):
    """LoRA over W8A8 projections (dynamic and static): the first step's logits agree
    with the same adapter over the dequantized weights, and what the adapter adds to
    them is the same."""
    check_quantized_base(tiny_models["qwen3"], adapters["qwen3"][1], tmp_path, scheme,
                         {"w8a8_dynamic": 0.999, "w8a8": 0.98}[scheme])


def check_quantized_base(base: Path, adapter: Path, tmp_path: Path, scheme: str,
                         least: float) -> None:
    """``adapter`` over ``base`` quantized by ``scheme`` against the same adapter over the
    dequantized weights: their first-step logits' cosine is at least ``least``, and what
    the adapter adds to the logits is the same."""
    from pdmesh.shared.cli.quantize import quantize_checkpoint
    from pdmesh.shared.models.loader import load_model

    folder = tmp_path / scheme
    quantize_checkpoint(base, folder, scheme)
    kw = dict(device="cpu", dtype="float32", block_size=16, quantization="ascend",
              enable_lora=True, max_lora_rank=8, enable_prefix_caching=False)
    quantized, floats = LLM(str(folder), **kw), LLM(str(folder), **kw)
    _, model = load_model(folder, floats.engine.backend, torch.float32,
                          floats.engine.model_config, "ascend", dequantize=True)
    floats.engine.model.w = model.w
    first = SamplingParams(temperature=0.0, max_tokens=1)
    logits = {}
    for name, llm in (("quantized", quantized), ("floats", floats)):
        for request in (None, lora(1, adapter)):
            with llm.engine.runner.logits_kept() as kept:
                llm.generate(PROMPTS, first, lora_request=request)
            logits[name, request is not None] = kept[0].double()

    def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())

    assert cosine(logits["quantized", False], logits["floats", False]) >= 0.99
    # (static W8A8's activation scales were calibrated on the base model's activations,
    # which an adapter moves: a little more of its error shows)
    assert cosine(logits["quantized", True], logits["floats", True]) >= least
    added = [logits[n, True] - logits[n, False] for n in ("quantized", "floats")]
    assert float(added[1].norm()) > 0.05 * float(logits["floats", False].norm())
    assert cosine(*added) > 0.95, cosine(*added)


def test_what_lora_cannot_run_with_is_refused(tiny_models, adapters, tmp_path):
    base = str(tiny_models["qwen3"])
    plain = LLM(base, device="cpu", dtype="float32", block_size=16)
    with pytest.raises(ValueError, match="lora_request: LoRA adapters are not enabled"):
        plain.generate(PROMPTS[:1], GREEDY, lora_request=lora(0, adapters["qwen3"][0]))
    for fields, words in [({"tensor_parallel_size": 2}, "not with tensor_parallel_size"),
                          ({"max_loras": 2, "max_cpu_loras": 1}, "max_cpu_loras: must be"),
                          ({"max_lora_rank": 0}, "max_lora_rank: must be >= 1")]:
        with pytest.raises(ValueError, match=words):
            EngineConfig(model=base, enable_lora=True, **fields).validate()
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        LLM(base, device="cpu", dtype="float32", block_size=16, enable_lora=True).generate(
            PROMPTS[:1], GREEDY, lora_request=LoRARequest("none", 1, str(tmp_path)))


def test_unloading_an_adapter_lets_its_running_requests_finish(tiny_models, adapters):
    """vLLM's load_lora_adapter / unload_lora_adapter in the engine: a loaded adapter
    is held (the routers read which); unloaded while a request runs it, the request
    finishes with it (the text as alone) and a new request by its name is refused,
    while one that carries the adapter's folder reads it again."""
    base, paths = tiny_models["qwen3"], adapters["qwen3"]
    llm = LLM(str(base), device="cpu", dtype="float32", block_size=16, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    engine = llm.engine
    alone = llm.generate(PROMPTS[:1], GREEDY, lora_request=lora(0, paths[0]))
    engine.unload_lora("adapter-0")
    assert engine.lora.names() == [] and engine.lora.held() == []
    engine.load_lora("adapter-0", str(paths[0]))
    engine.load_lora("adapter-1", str(paths[1]))
    assert engine.lora.held() == ["adapter-0", "adapter-1"]
    req = engine.add_request(PROMPTS[0], GREEDY, request_id="a",
                             lora_request=engine.lora_request("adapter-0"))
    engine.step()
    engine.unload_lora("adapter-0")  # (a request runs it: it stays until that is done)
    assert engine.lora.names() == ["adapter-1"] and engine.lora.held() == ["adapter-1"]
    with pytest.raises(ValueError, match="model: the LoRA adapter 'adapter-0' is not loaded"):
        engine.lora_request("adapter-0")
    with pytest.raises(KeyError):
        engine.unload_lora("adapter-0")
    while engine.has_unfinished():
        engine.step()
    assert req.output_token_ids == alone[0].outputs[0].token_ids
    again = engine.lora_request("adapter-0", str(paths[0]))  # (read anew: it left)
    assert "adapter-0" not in engine.lora.slots.names
    out = llm.generate(PROMPTS[:1], GREEDY, lora_request=again)
    assert out[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        engine.load_lora("none", str(base))
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
