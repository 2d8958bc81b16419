"""The request bodies as vLLM reads them: an explicit null is the field's default."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdmesh.services.gateway.protocol import ChatCompletionRequest, CompletionRequest, render_chat

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


def test_a_field_it_does_not_know_is_accepted_and_warned_of_once(caplog):
    """As vLLM: ignored, one warning per field name for the life of the process."""
    name = f"bogus_{id(caplog)}"  # a name no other test has warned of
    with caplog.at_level("WARNING", logger="pdmesh.services.gateway.protocol"):
        for _ in range(3):
            r = ChatCompletionRequest.model_validate({**CHAT, name: 1, "metadata": {"a": 1}})
    assert r.model_extra == {name: 1}
    warned = [rec.getMessage() for rec in caplog.records if name in rec.getMessage()]
    assert len(warned) == 1 and "ignored" in warned[0]


def test_a_completion_without_max_tokens_asks_for_16():
    """OpenAI's default for completions, also for an explicit null (vLLM 0.32 reads that
    as "what fits"); chat asks for what fits."""
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x"}).to_sampling(
        100).max_tokens == 16
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x"}).to_sampling(
        5).max_tokens == 5  # a default never runs past the context
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": None}
                                            ).to_sampling(100).max_tokens == 16
    assert ChatCompletionRequest.model_validate(CHAT).to_sampling(100).max_tokens == 100
    asked = ChatCompletionRequest.model_validate({**CHAT, "max_completion_tokens": 9,
                                                  "max_tokens": 3})
    assert asked.asked_max_tokens() == ("max_completion_tokens", 9)


@pytest.mark.parametrize(("content", "needle"), [
    ([{"type": "text", "text": 123}], "text must be a string"),
    ([{"type": "image_url", "image_url": {"url": "data:,"}}], "image_url"),
    ([{"type": "input_audio", "input_audio": {}}], "input_audio"),
    ([{"text": "no type"}], "None"),
])
def test_content_parts_other_than_text_are_refused_not_dropped(content, needle):
    with pytest.raises(ValidationError, match=needle) as e:
        ChatCompletionRequest.model_validate(
            {**CHAT, "messages": [{"role": "user", "content": content}]})
    assert e.value.errors()[0]["loc"][:3] == ("messages", 0, "content")


def test_history_tool_calls_reach_the_template_with_mapping_arguments():
    r = ChatCompletionRequest.model_validate({**CHAT, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                      "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "f", "arguments": '{"x": [1, 2]}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}]})
    got = [m.for_template() for m in r.messages]
    assert got[0] == {"role": "user", "content": "ab"}
    assert got[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": [1, 2]}}
    assert got[2] == {"role": "tool", "content": "3", "tool_call_id": "c1"}


@pytest.mark.parametrize(("body", "needle"), [
    ({"model": "m", "prompt": "x", "suffix": "y"}, "fill-in-the-middle"),
    ({"model": "m", "prompt": "x", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ({"model": "m", "prompt": "x", "response_format": {"type": "bogus"}}, "response_format"),
])
def test_what_cannot_be_served_is_refused_naming_it(body, needle):
    with pytest.raises(ValidationError, match=needle):
        CompletionRequest.model_validate(body)


def test_continue_final_message_needs_the_assistant_last():
    with pytest.raises(ValidationError, match="continue_final_message"):
        ChatCompletionRequest.model_validate({**CHAT, "continue_final_message": True,
                                              "add_generation_prompt": False})
    r = ChatCompletionRequest.model_validate({**CHAT, "continue_final_message": True,
                                              "messages": [*CHAT["messages"], {
                                                  "role": "assistant", "content": "Sure"}]})
    class Template:  # what render_chat hands the chat template
        def apply_chat_template(self, messages, **kwargs):
            self.messages, self.kwargs = messages, kwargs
            return "text"

    template = Template()
    assert render_chat(template, r) == "text"
    assert template.kwargs["add_generation_prompt"] is False
    assert template.kwargs["continue_final_message"] is True
    assert template.messages[-1] == {"role": "assistant", "content": "Sure"}


def test_prompt_logprobs_as_vllm_asks_them():
    """As given (completions and chat); an echo with logprobs asks as many for the
    echoed prompt; 0 may stream (it asks for the prompt's own tokens only)."""
    def cmpl(**kw):
        return CompletionRequest.model_validate({"model": "m", "prompt": "x", **kw})

    assert cmpl(prompt_logprobs=3).to_sampling(8).prompt_logprobs == 3
    assert cmpl(echo=True, logprobs=2).to_sampling(8).prompt_logprobs == 2
    assert cmpl(echo=True, logprobs=2, prompt_logprobs=5).to_sampling(8).prompt_logprobs == 5
    assert cmpl(echo=True).to_sampling(8).prompt_logprobs is None
    assert cmpl(logprobs=2).to_sampling(8).prompt_logprobs is None
    assert cmpl(prompt_logprobs=0, stream=True).to_sampling(8).prompt_logprobs == 0
    chat = ChatCompletionRequest.model_validate({**CHAT, "prompt_logprobs": 1})
    assert chat.to_sampling(8).prompt_logprobs == 1
    with pytest.raises(ValidationError, match="prompt_logprobs"):
        ChatCompletionRequest.model_validate({**CHAT, "prompt_logprobs": 1, "stream": True})


def test_legacy_function_messages_and_either_reasoning_name_reach_the_template():
    """role "function" (a function's result, as older agent frameworks send it) is read
    as a tool message; an assistant turn's reasoning by vLLM 0.32's name or the older
    one reaches templates under both."""
    from pdmesh.services.gateway.protocol import ChatMessage

    fn = ChatMessage.model_validate({"role": "function", "name": "f", "content": "42"})
    assert fn.for_template() == {"role": "tool", "name": "f", "content": "42"}
    for key in ("reasoning", "reasoning_content"):
        turn = ChatMessage.model_validate({"role": "assistant", "content": "a", key: "r"})
        assert turn.for_template()["reasoning_content"] == "r"
        assert turn.for_template()["reasoning"] == "r"
