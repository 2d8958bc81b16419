"""Several answers in one (``n`` > 1, ``best_of``, a completion's batch of prompts): one
Answer per choice, each prompt's other choices started once its first one's prompt is
computed, so they find its KV in the pool (and the prefill instance's prefix cache) and
compute it no more; merged here into one answer, whole or streamed.

``best_of`` > ``n`` (completions): every candidate is generated, the ``n`` with the
highest cumulative logprob of their sampled tokens are answered (OpenAI's rule).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from pdmesh.services.gateway.answer import Answer


def merge_whole(answers: list[Answer], wholes: list[dict[str, Any]], n: int, k: int
                ) -> dict[str, Any]:
    """One answer: per prompt (``k`` answers each), its ``n`` best choices (all of them
    unless best_of asked more), numbered prompt by prompt as vLLM numbers them."""
    if len(wholes) == 1:
        return wholes[0]
    choices = []
    for start in range(0, len(wholes), k):
        order = list(range(start, start + k))
        if k > n:  # best_of: the n most likely
            order = sorted(order, key=lambda i: -answers[i].cumulative_logprob)[:n]
        choices += [{**wholes[i]["choices"][0], "index": len(choices) + rank}
                    for rank, i in enumerate(order)]
    out = dict(wholes[0])
    out["choices"] = choices
    out["usage"] = usage(answers, k)
    return out


def usage(answers: list[Answer], k: int, streamed: bool = False) -> dict[str, Any]:
    """Each prompt once; the tokens generated for every choice (best_of's too);
    ``streamed``: its null fields left out (Answer.usage)."""
    prompt = sum(len(a.prompt) for a in answers[::k])
    generated = sum(a.completion_tokens for a in answers)
    cached = sum(a.cached_tokens for a in answers[::k])
    out = {"prompt_tokens": prompt, "completion_tokens": generated,
           "total_tokens": prompt + generated,
           "prompt_tokens_details": {"cached_tokens": cached},
           "completion_tokens_details": None}
    details = [a.output.usage_details for a in answers if a.output is not None]
    if details and all(d is not None for d in details):
        out["completion_tokens_details"] = {"reasoning_tokens": sum(
            d["reasoning_tokens"] for d in details)}  # type: ignore[index]
    return {f: v for f, v in out.items() if v is not None} if streamed else out


async def merged_sse(answers: list[Answer], k: int, include_usage: bool
                     ) -> AsyncIterator[str]:
    """The choices' streams interleaved as their events come (each chunk names its
    choice's index), one usage chunk after the last, one ``[DONE]``."""
    queue: asyncio.Queue[str | None] = asyncio.Queue()

    async def pump(answer: Answer) -> None:
        try:
            async for event in answer.sse(include_usage=False):
                if event != "data: [DONE]\n\n":
                    await queue.put(event)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(a)) for a in answers]
    try:
        left = len(tasks)
        while left:
            event = await queue.get()
            if event is None:
                left -= 1
            else:
                yield event
        if include_usage:
            first = answers[0]
            yield "data: " + json.dumps({
                "id": first.rid, "object": "chat.completion.chunk" if first.chat
                else "text_completion", "created": first.created, "model": first.model,
                "choices": [], "usage": usage(answers, k, streamed=True)}) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for a in answers:
            await a.close()
