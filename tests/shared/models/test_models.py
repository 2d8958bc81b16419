"""Model folders: tiny-model determinism, loading errors, dtypes, tokenizer and chat template."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import pytest
import torch

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.models import ModelConfig, Tokenizer
from pdmesh.shared.models import encoding_dsv4 as dsv4
from pdmesh.shared.models.tiny import make_tiny_model


def digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_tiny_model_is_deterministic_by_seed(tmp_path, bpe_tokenizer):
    a = make_tiny_model(tmp_path / "a", "qwen3_moe", seed=3, tokenizer=bpe_tokenizer)
    b = make_tiny_model(tmp_path / "b", "qwen3_moe", seed=3, tokenizer=bpe_tokenizer)
    c = make_tiny_model(tmp_path / "c", "qwen3_moe", seed=4, tokenizer=bpe_tokenizer)
    assert digest(a) == digest(b) != digest(c)
    cfg = ModelConfig.from_folder(a)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (256, 768, 4, 8, 2, 32, 4096)
    assert cfg.moe is not None and (cfg.moe.num_experts, cfg.moe.top_k,
                                    cfg.moe.intermediate_size) == (8, 2, 256)


def test_tokenizer_round_trip_and_chat_template(qwen3_path):
    tok = Tokenizer(qwen3_path)
    text = "def add(a, b):\n    return a + b  # é ✓"
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == 4096
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_id == ModelConfig.from_folder(qwen3_path).eos_token_ids[0]


def test_the_tiny_deepseek_v4_ships_v4s_tokens(tiny_models, bpe_tokenizer, tmp_path):
    """V4's BOS / EOS are its config's, its chat markup encodes as whole tokens through
    --tokenizer-mode deepseek_v4 (and stays text on decode, for the parsers), no chat
    template ships (V4 has none), and a tokenizer without V4's tokens is refused."""
    path = tiny_models["deepseek_v4"]
    tok = Tokenizer(path, mode="deepseek_v4")
    cfg = ModelConfig.from_folder(path)
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_ids[0])
    assert tok.vocab_size == cfg.vocab_size == 4096 and tok.chat_template is None
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "reasoning_content": "r",
             "tool_calls": [{"type": "function", "function": {"name": "f",
                                                               "arguments": {"x": 1}}}]},
            {"role": "tool", "content": "42"}]
    text = tok.apply_chat_template(chat, tools=tools, thinking=True)
    ids = tok.encode(text, add_special_tokens=False)
    markup = {t: tok.encode(t, add_special_tokens=False) for t in
              (dsv4.USER, dsv4.ASSISTANT, dsv4.THINK_START, dsv4.THINK_END, dsv4.DSML)}
    assert all(len(one) == 1 for one in markup.values()), markup
    assert ids[0] == tok.bos_token_id and ids.count(tok.eos_token_id) == 1
    for t, [one] in markup.items():
        assert ids.count(one) == text.count(t), t
    assert tok.decode(ids) == text.removeprefix(dsv4.BOS).replace(dsv4.EOS, "")
    assert tok.encode("hi")[0] == tok.bos_token_id  # add_bos_token, as V4's config says
    # thinking unless told otherwise (vLLM's deepseek_v4 mode); reasoning_effort none: off
    assert tok.apply_chat_template(chat[:1]).endswith(dsv4.ASSISTANT + dsv4.THINK_START)
    assert tok.apply_chat_template(chat[:1], reasoning_effort="none").endswith(
        dsv4.ASSISTANT + dsv4.THINK_END)
    with pytest.raises(ValueError, match="--tokenizer-mode deepseek_v4"):
        Tokenizer(path).apply_chat_template(chat[:1])
    with pytest.raises(ValueError, match="tokenizer: lacks deepseek_v4's tokens"):
        make_tiny_model(tmp_path / "v4", "deepseek_v4", tokenizer=bpe_tokenizer)


def test_the_generation_configs_end_of_sequence_ids_end_a_request(tmp_path, qwen3_path):
    """generation_config.json's eos_token_id list (Qwen's and Llama's chat models name
    more than config.json) ends a request too, as in vLLM, with the id as its stop_reason
(the model's own end of sequence gives none); a malformed one is refused."""
    model = tmp_path / "m"
    shutil.copytree(qwen3_path, model)
    tok = Tokenizer(model)
    other = tok.encode("<|endoftext|>", add_special_tokens=False)[0]
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(
        {**gen, "eos_token_id": [tok.eos_token_id, other]}))
    assert ModelConfig.from_folder(model).eos_token_ids == (tok.eos_token_id, other)
    llm = LLM(str(model), device="cpu", dtype="float32")
    push = SamplingParams(temperature=0, max_tokens=8, logit_bias={other: 100.0})
    out = llm.generate([[40, 41, 42]], push)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([other], "stop", other)
    first = llm.generate([[40, 41, 42]], SamplingParams(
        temperature=0, max_tokens=8, logit_bias={tok.eos_token_id: 100.0}))[0].outputs[0]
    assert (first.token_ids, first.stop_reason) == ([tok.eos_token_id], None)  # (vLLM's)
    kept = llm.generate([[40, 41, 42]], SamplingParams(
        temperature=0, max_tokens=8, logit_bias={other: 100.0}, ignore_eos=True))
    assert kept[0].outputs[0].token_ids == [other] * 8
    # config.json listing another first (Llama 3.1's): the tokenizer's own is still the
    # one without a stop_reason, as tokenizer_config.json names it
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [other,
                                                                         tok.eos_token_id]}))
    tc = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tc, "added_tokens_decoder": {
        str(tok.eos_token_id): {"content": tc["eos_token"], "special": True}}}))
    assert ModelConfig.from_folder(model).eos_token_ids == (tok.eos_token_id, other)
    llm = LLM(str(model), device="cpu", dtype="float32")
    for pushed, reason in ((tok.eos_token_id, None), (other, other)):
        out = llm.generate([[40, 41, 42]], SamplingParams(
            temperature=0, max_tokens=8, logit_bias={pushed: 100.0}))[0].outputs[0]
        assert (out.token_ids, out.stop_reason) == ([pushed], reason)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
        ModelConfig.from_folder(model)


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_is_named(tmp_path, qwen3_path, missing):
    folder = tmp_path / "m"
    shutil.copytree(qwen3_path, folder)
    (folder / missing).unlink()
    expected = "safetensors" if missing == "model.safetensors" else missing
    with pytest.raises(FileNotFoundError, match=expected):
        LLM(str(folder), device="cpu")


def test_unknown_architecture_and_missing_tensor(tmp_path, qwen3_path):
    folder = tmp_path / "m"
    shutil.copytree(qwen3_path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        LLM(str(folder), device="cpu")
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    cfg["num_hidden_layers"] = 5  # the checkpoint has 4
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model.layers.4"):
        LLM(str(folder), device="cpu")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_tracks_float32(qwen3_path, dtype):
    """Half precision loads, runs, and its first-token logits stay close to float32."""
    prompts = [[11, 12, 13, 14, 15], list(range(100, 140))]
    ref = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)
    half = LLM(str(qwen3_path), device="cpu", dtype=dtype, block_size=16)
    assert half.engine.model.dtype == getattr(torch, dtype)
    p = SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True)
    a, b = ref.generate(prompts, p), half.generate(prompts, p)
    for x, y in zip(a, b, strict=True):
        lx, ly = x.outputs[0].logprobs[0], y.outputs[0].logprobs[0]
        first = x.outputs[0].token_ids[0]
        assert first in ly  # float32's choice is among the half model's top 5
        assert abs(lx[first].logprob - ly[first].logprob) < 0.1


def test_cli_make_tiny_model_and_generate(tmp_path):
    out = tmp_path / "cli-model"
    run = subprocess.run([sys.executable, "-m", "pdmesh", "make-tiny-model", str(out),
                          "--arch", "llama", "--seed", "7"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert ModelConfig.from_folder(out).architecture == "LlamaForCausalLM"
    # the model positionally, as `vllm serve MODEL` takes it
    gen = subprocess.run([sys.executable, "-m", "pdmesh", "generate", str(out),
                          "--device", "cpu", "--prompt", "import os", "--max-tokens", "5"],
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    assert "[5 tokens, finish_reason=length]" in gen.stdout
    bad = subprocess.run([sys.executable, "-m", "pdmesh", "generate", "--model",
                          str(tmp_path / "nope"), "--device", "cpu"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "config.json" in bad.stderr


def test_fingerprint_follows_content_not_path(tmp_path, qwen3_path, bpe_tokenizer):
    from pdmesh.shared.models.checkpoint import model_fingerprint

    copy = tmp_path / "elsewhere"
    shutil.copytree(qwen3_path, copy)
    assert model_fingerprint(copy) == model_fingerprint(qwen3_path)
    other = make_tiny_model(tmp_path / "other", "qwen3", seed=1, tokenizer=bpe_tokenizer)
    assert model_fingerprint(other) != model_fingerprint(qwen3_path)  # same layout


def test_expert_skew_makes_a_few_experts_hot(tmp_path, bpe_tokenizer):
    from pdmesh.shared.engine.build import build_engine
    from pdmesh.shared.engine.config import EngineConfig
    from pdmesh.shared.models.tiny import hot_experts

    def hot_share(skew: float) -> list[float]:
        path = make_tiny_model(tmp_path / f"skew-{skew}", "qwen3_moe", seed=0,
                               tokenizer=bpe_tokenizer, expert_skew=skew)
        eng = build_engine(EngineConfig(model=str(path), device="cpu", dtype="float32",
                                        expert_load_window=100))
        for i in range(8):
            eng.add_request(list(range(50 + 97 * i, 90 + 97 * i)),
                            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        load = eng.model.load_recorder.load().float()
        experts = load.shape[1]
        return [(load[i, hot_experts(i, experts)].sum() / load[i].sum()).item()
                for i in range(load.shape[0])]

    plain, skewed = hot_share(0.0), hot_share(0.3)
    assert all(s > 0.45 for s in skewed), skewed  # a quarter of the experts: 0.25 if even
    assert sum(skewed) > sum(plain) + 0.8
    with pytest.raises(ValueError, match="expert_skew"):
        make_tiny_model(tmp_path / "dense", "qwen3", tokenizer=bpe_tokenizer, expert_skew=0.3)
