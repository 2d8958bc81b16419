"""The pooling runner (vLLM's --runner pooling, SGLang's --is-embedding): embeddings equal
transformers' final hidden states pooled (LAST, MEAN, CLS; normalized or not), whatever
the chunking, the prefix cache and the batch; the checkpoint's sentence-transformers
files and --pooler-config set the defaults; a request that does not fit is refused
naming its field."""

from __future__ import annotations

import json

import pytest
import torch

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.engine.pooling import PoolingParams, model_pooling
from tests.model_folders import linked_model

_g = torch.Generator().manual_seed(99)
_base = torch.randint(10, 4000, (40,), generator=_g).tolist()
PROMPTS = [
    torch.randint(10, 4000, (1,), generator=_g).tolist(),
    _base + torch.randint(10, 4000, (9,), generator=_g).tolist(),
    torch.randint(10, 4000, (77,), generator=_g).tolist(),
    _base + torch.randint(10, 4000, (25,), generator=_g).tolist(),
]


def hf_hidden(path, prompts) -> list[torch.Tensor]:
    """transformers' last_hidden_state (after the final norm) of each prompt, alone."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


def pooled(hidden: torch.Tensor, kind: str, normalize: bool) -> torch.Tensor:
    vec = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[kind]
    return torch.nn.functional.normalize(vec, dim=-1) if normalize else vec


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_embeddings_equal_transformers_pooled_hidden_states(tiny_models, arch):
    path = tiny_models[arch]
    reference = hf_hidden(path, PROMPTS)
    for kind, normalize, extra in (("LAST", True, {}),
                                   ("MEAN", False, {"max_num_batched_tokens": 24}),
                                   ("CLS", True, {"max_num_batched_tokens": 24})):
        llm = LLM(str(path), device="cpu", dtype="float32", block_size=16, runner="pooling",
                  pooler_config={"pooling_type": kind, "use_activation": normalize}, **extra)
        for _ in range(2):  # the second pass: the shared prefix is in the prefix cache
            outs = llm.embed(PROMPTS)
            for out, hidden in zip(outs, reference, strict=True):
                got = torch.tensor(out.outputs.embedding)
                torch.testing.assert_close(got, pooled(hidden, kind, normalize),
                                           rtol=1e-4, atol=1e-4, msg=f"{arch} {kind}")
        assert not llm.engine.has_unfinished()


def test_deepseek_v4_s_embedding_is_what_its_head_reads(tiny_models):
    """DeepSeek-V4's rows are hyper-connection streams: the embedding is them collapsed
    and normed, so its head on the LAST embedding scores the token greedy decoding
    picks, with the logprob decoding reports."""
    path = tiny_models["deepseek_v4"]
    gen = LLM(str(path), device="cpu", dtype="float32", block_size=16)
    firsts = gen.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1,
                                                  ignore_eos=True, logprobs=0))
    head = gen.engine.model.w.lm_head.float()  # [hidden, vocab]
    pool = LLM(str(path), device="cpu", dtype="float32", block_size=16, runner="pooling",
               pooler_config={"normalize": False})
    for emb, first in zip(pool.embed(PROMPTS), firsts, strict=True):
        logprobs = torch.log_softmax(torch.tensor(emb.outputs.embedding) @ head, -1)
        token = first.outputs[0].token_ids[0]
        assert int(logprobs.argmax()) == token
        assert float(logprobs[token]) == pytest.approx(
            first.outputs[0].logprobs[0][token].logprob, abs=1e-4)


def test_the_checkpoint_s_sentence_transformers_files_set_the_defaults(qwen3_path, tmp_path):
    model = linked_model(qwen3_path, tmp_path / "st")
    assert model_pooling(model)[0].type == "LAST"
    (model / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
    pooling, unused = model_pooling(model)
    assert (pooling.type, pooling.normalize, unused) == ("MEAN", False, [])
    # --pooler-config over it; a key pdmesh does not pool by is named
    pooling, unused = model_pooling(model, {"normalize": True, "softmax": True})
    assert (pooling.type, pooling.normalize, unused) == ("MEAN", True, ["softmax"])
    [one] = LLM(str(model), device="cpu", dtype="float32", block_size=16,
                runner="pooling").embed([PROMPTS[2]])
    reference = hf_hidden(qwen3_path, [PROMPTS[2]])[0]
    torch.testing.assert_close(torch.tensor(one.outputs.embedding), reference.mean(0),
                               rtol=1e-4, atol=1e-4)


def test_dimensions_cut_a_matryoshka_model_s_embedding(qwen3_path, tmp_path):
    model = linked_model(qwen3_path, tmp_path / "mrl",
                         config={"matryoshka_dimensions": [8, 16]})
    llm = LLM(str(model), device="cpu", dtype="float32", block_size=16, runner="pooling")
    full = llm.embed([PROMPTS[1]], PoolingParams(use_activation=False))[0].outputs.embedding
    cut = llm.embed([PROMPTS[1]], PoolingParams(dimensions=8))[0].outputs.embedding
    expected = torch.nn.functional.normalize(torch.tensor(full[:8]), dim=-1)
    torch.testing.assert_close(torch.tensor(cut), expected, rtol=1e-5, atol=1e-5)


def test_requests_the_runner_does_not_serve_are_refused(qwen3_path):
    gen = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)
    with pytest.raises(ValueError, match="--runner pooling"):
        gen.embed([[1, 2, 3]])
    pool = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16,
               runner="pooling")
    with pytest.raises(ValueError, match="serves embeddings, not generation"):
        pool.generate([[1, 2, 3]])
    with pytest.raises(ValueError, match="dimensions: .*Matryoshka"):
        pool.embed([[1, 2, 3]], PoolingParams(dimensions=4))
    with pytest.raises(ValueError, match="prompt_token_ids: .*outside the vocabulary"):
        pool.embed([[1, 2, 10**7]])
    with pytest.raises(ValueError, match="pooling_type"):
        LLM(str(qwen3_path), device="cpu", block_size=16, runner="pooling",
            pooler_config={"pooling_type": "MAX"})
    assert not pool.engine.has_unfinished()
