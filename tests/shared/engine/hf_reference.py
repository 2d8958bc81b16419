"""Greedy continuations from Hugging Face transformers: the parity reference.

transformers is a test-only dependency; this module is imported by tests alone.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from pdmesh.shared.engine.request import Logprob


def hf_greedy(path: Path, prompts: list[list[int]], new_tokens: int,
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """Token-by-token argmax over the whole sequence each step (no HF cache API, which
    changes between releases); EOS neither stops nor is masked."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(new_tokens):
                logits = model(torch.tensor([seq])).logits
                seq.append(int(logits[0, -1].float().argmax()))
            outs.append(seq[len(prompt):])
    return outs


def hf_greedy_stepwise(path: Path, prompts: list[list[int]], new_tokens: int,
                       dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """Greedy continuations with every token, the prompt's too, fed one at a time through
    transformers' cache. DeepSeek-V4's reference: its one-shot prefill is not causal on
    long prompts (logits at a position change when later tokens are appended), feeding
    token by token is (each step sees exactly the tokens before it)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation="eager").eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            cache = DynamicCache(config=model.config)
            out: list[int] = []
            logits = None
            for token in list(prompt) + [None] * new_tokens:
                if token is None:
                    assert logits is not None
                    token = int(logits.float().argmax())
                    out.append(token)
                    if len(out) == new_tokens:
                        break
                logits = model(input_ids=torch.tensor([[token]]), cache=cache,
                               use_cache=True).logits[0, -1]
            outs.append(out)
    return outs


def assert_greedy_twice(llm, prompts: list[list[int]], want: list[list[int]],
                        new_tokens: int) -> list:
    """Generate greedily twice (the second pass sees a warm prefix cache where it is on):
    each time every prompt's tokens equal ``want`` and no block of any cache group is
    left held. Returns the second pass's outputs."""
    from pdmesh.shared.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate(prompts, params)
        got = [o.outputs[0].token_ids for o in outs]
        for i, (g, r) in enumerate(zip(got, want, strict=True)):
            assert g == r, f"prompt {i} (len {len(prompts[i])}) diverged at " \
                           f"{next(j for j in range(len(r)) if g[j] != r[j])}"
        for name, (free, total) in llm.engine.kv.usage().items():
            assert free == total, f"{name}: {total - free} blocks leaked"
    return outs


def hf_prompt_logprobs(path: Path, prompt: list[int]) -> torch.Tensor:
    """log_softmax of one forward pass over ``prompt``: row j scores token j + 1,
    [len(prompt), V] float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def assert_like_reference(got: list[dict[int, Logprob] | None], prompt: list[int],
                          ref: torch.Tensor, n: int) -> None:
    """``got`` holds one entry per prompt token: None first, then the token's logprob
    and rank under ``ref`` (row j - 1 scores token j) and the top ``n`` of that row."""
    assert len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        row, tok = ref[j - 1], prompt[j]
        entry = got[j]
        assert entry is not None and next(iter(entry)) == tok, j  # its own token first
        assert math.isclose(entry[tok].logprob, row[tok].item(), abs_tol=1e-4), j
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1, j
        top = row.topk(n)
        assert set(entry) == {tok, *top.indices.tolist()}, j
        for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist(),
                                                strict=True), start=1):
            assert math.isclose(entry[tid].logprob, value, abs_tol=1e-4), j
            if tid != tok:
                assert entry[tid].rank == rank, j


def from_json(entries: list[dict[str, dict] | None]) -> list[dict[int, Logprob] | None]:
    """An OpenAI answer's ``prompt_logprobs`` (vLLM's shape) as the engine's."""
    return [None if e is None else {int(k): Logprob(v["logprob"], v["rank"])
                                    for k, v in e.items()} for e in entries]
