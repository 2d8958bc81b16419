"""vLLM's --hf-overrides (SGLang's --json-model-override-args): config.json's rope and
position keys laid over the checkpoint's, for the engine, its KV keys and the gateway;
any other key is refused, naming it."""

from __future__ import annotations

import pytest
import torch

from pdmesh.shared.config.serve import serve_config
from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.models.config import ModelConfig

PROMPT = list(range(30, 90))


def first_logits(llm: LLM) -> torch.Tensor:
    with llm.engine.runner.logits_kept() as kept:
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))
    return kept[0]


def test_rope_and_positions_are_overridden(qwen3_path):
    base = ModelConfig.from_folder(qwen3_path)
    over = ModelConfig.from_folder(qwen3_path, {"max_position_embeddings": 2 * base.
                                                max_position_embeddings, "rope_theta": 500.0})
    assert over.max_position_embeddings == 2 * base.max_position_embeddings
    assert over.rope_theta == 500.0 and base.rope_theta != 500.0
    plain = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)
    same = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16,
               hf_overrides={"rope_theta": base.rope_theta})
    other = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16,
                hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 4.0}})
    torch.testing.assert_close(first_logits(same), first_logits(plain))
    assert not torch.allclose(first_logits(other), first_logits(plain), atol=1e-3)
    # KV computed under another rope is not the checkpoint's: other pool keys
    assert other.engine.kv_fingerprint != plain.engine.kv_fingerprint
    assert same.engine.kv_fingerprint != plain.engine.kv_fingerprint  # (said, so kept apart)


def test_every_command_reads_it_and_refuses_a_weight_key(qwen3_path):
    cfg = serve_config("mixed", [str(qwen3_path), "--device", "cpu",
                                 "--json-model-override-args", '{"rope_theta": 20000.0}'])
    assert cfg.engine.hf_overrides == {"rope_theta": 20000.0}
    with pytest.raises(ValueError, match="^--hf-overrides: hidden_size: "):
        serve_config("config check", ["--role", "mixed", "--model", "/tmp/m", "--device",
                                      "cpu", "--hf-overrides", '{"hidden_size": 8}'])
    with pytest.raises(ValueError, match="^--hf-overrides: num_hidden_layers: "):
        LLM(str(qwen3_path), device="cpu", hf_overrides={"num_hidden_layers": 1})
