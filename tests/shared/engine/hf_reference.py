"""Greedy continuations from Hugging Face transformers: the parity reference.

transformers is a test-only dependency; this module is imported by tests alone.
"""

from __future__ import annotations

from pathlib import Path

import torch


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
