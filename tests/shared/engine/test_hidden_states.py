"""SGLang's return_hidden_states: a request's answer carries the final (normed) hidden
state of the last token the model was fed - transformers' last_hidden_state there - and
none when only its prompt was fed."""

from __future__ import annotations

import pytest
import torch

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.engine.hidden_states import answer_hidden_states

PROMPT = list(range(20, 61))


def run(llm: LLM, max_tokens: int, chunk: bool = False):
    engine = llm.engine
    req = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    ignore_eos=True,
                                                    return_hidden_states=True))
    while engine.has_unfinished():
        engine.step()
    return req


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_the_last_fed_token_s_hidden_state(tiny_models, arch):
    from transformers import AutoModel

    path = tiny_models[arch]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16,
              max_num_batched_tokens=16)  # (the prompt in chunks)
    req = run(llm, 4)
    fed = PROMPT + req.output_token_ids[:-1]  # the last token generated is never fed
    with torch.inference_mode():
        hf = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
        want = hf(torch.tensor([fed])).last_hidden_state[0, -1]
    torch.testing.assert_close(torch.tensor(answer_hidden_states(req)), want, rtol=1e-4,
                               atol=1e-4)
    # one token generated: only the prompt was fed, so none (SGLang's answer)
    assert answer_hidden_states(run(llm, 1)) == []


def test_refused_beside_speculative_decoding(qwen3_path):
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="^return_hidden_states: "):
        llm.generate([PROMPT], SamplingParams(return_hidden_states=True))
