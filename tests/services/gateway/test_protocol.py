"""The request bodies as vLLM reads them: an explicit null is the field's default."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdmesh.services.gateway.protocol import ChatCompletionRequest, CompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_explicit_nulls_are_the_defaults():
    nulls = {k: None for k in ("n", "stream", "presence_penalty", "frequency_penalty",
                               "min_tokens", "ignore_eos", "skip_special_tokens", "logprobs",
                               "temperature", "max_tokens", "seed")}
    chat = ChatCompletionRequest.model_validate({**CHAT, **nulls})
    assert (chat.n, chat.stream, chat.logprobs, chat.presence_penalty) == (1, False, False, 0.0)
    assert chat.to_sampling(16).max_tokens == 16
    cmpl = CompletionRequest.model_validate({"model": "m", "prompt": "x", **nulls})
    assert (cmpl.n, cmpl.stream, cmpl.logprobs, cmpl.echo) == (1, False, None, False)
    assert cmpl.to_sampling(7).frequency_penalty == 0.0


@pytest.mark.parametrize("field", ["model", "messages"])
def test_a_required_field_sent_as_null_is_still_missing(field):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({**CHAT, field: None})
    assert e.value.errors()[0]["loc"] == (field,)


def test_a_field_it_does_not_know_is_still_refused():
    with pytest.raises(ValidationError, match="bogus"):
        ChatCompletionRequest.model_validate({**CHAT, "bogus": None})
