"""Several answers to one prompt (``n`` > 1, ``best_of``): one Answer per choice, their
journeys started once the first one's prompt is computed, so the others find its KV in
the pool (and the prefill instance's prefix cache) and compute it no more; merged here
into one answer, whole or streamed.

``best_of`` > ``n`` (completions): every candidate is generated, the ``n`` with the
highest cumulative logprob of their sampled tokens are answered (OpenAI's rule).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from pdmesh.services.gateway.answer import Answer


def merge_whole(answers: list[Answer], wholes: list[dict[str, Any]], n: int
                ) -> dict[str, Any]:
    """One answer of the ``n`` best choices (all of them unless best_of asked more)."""
    if len(wholes) == 1:
        return wholes[0]
    order = list(range(len(wholes)))
    if len(wholes) > n:  # best_of: the n most likely
        order = sorted(order, key=lambda i: -answers[i].cumulative_logprob)[:n]
    choices = [{**wholes[i]["choices"][0], "index": k} for k, i in enumerate(order)]
    out = dict(wholes[0])
    out["choices"] = choices
    out["usage"] = usage(answers)
    return out


def usage(answers: list[Answer]) -> dict[str, Any]:
    """The prompt once; the tokens generated for every choice (best_of's too)."""
    one = answers[0].usage()
    generated = sum(a.completion_tokens for a in answers)
    return {**one, "completion_tokens": generated,
            "total_tokens": one["prompt_tokens"] + generated}


async def merged_sse(answers: list[Answer], include_usage: bool) -> AsyncIterator[str]:
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
                "choices": [], "usage": usage(answers)}) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for a in answers:
            await a.close()
