"""A corpus of bad requests to the gateway: each one must get a 4xx in OpenAI's error
shape naming what is wrong, and leave the gateway healthy.

Each case: (name, path, body, status, needle). ``body`` is a JSON-able value (sent as
JSON), or bytes (sent as they are, with ``Content-Type: application/json``); ``needle``
must appear in the error's message.
"""

from __future__ import annotations

from typing import Any

INT32_MAX = 2**31 - 1

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"


def _cases(model: str) -> list[tuple[str, str, Any, int, str]]:
    def c(**fields: Any) -> dict[str, Any]:
        return {"model": model, "prompt": "x", **fields}

    def m(**fields: Any) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}

    big = 2**40
    return [
        # -- the body as a whole ------------------------------------------------------------
        ("not-json", CMPL, b"{", 400, "JSON"),
        ("empty-body", CMPL, b"", 400, "body"),
        ("json-array", CMPL, [], 400, "body"),
        ("json-string", CMPL, "hello", 400, "body"),
        ("json-number", CMPL, 5, 400, "body"),
        ("json-null", CMPL, None, 400, "body"),
        ("invalid-utf8", CMPL, b'{"model": "\xff\xfe", "prompt": "x"}', 400, "UTF-8"),
        ("deep-nesting", CMPL, b'{"model": "m", "prompt": ' + b"[" * 100_000
         + b"]" * 100_000 + b"}", 400, "nest"),
        ("huge-int-literal", CMPL, b'{"model": "m", "prompt": "x", "max_tokens": 1'
         + b"0" * 5000 + b"}", 400, "number"),
        ("inf-literal", CMPL, b'{"model": "m", "prompt": "x", "temperature": 1e999}', 400,
         "temperature"),
        ("nan-literal", CMPL, b'{"model": "m", "prompt": "x", "temperature": NaN}', 400,
         "temperature"),
        ("infinity-literal", CMPL, b'{"model": "m", "prompt": "x", "top_p": -Infinity}', 400,
         "top_p"),
        ("logit-bias-not-a-token", CMPL, c(logit_bias={"abc": 5}), 400, "logit_bias"),
        ("logit-bias-past-vocab", CMPL, c(logit_bias={"99999": 5}), 400, "logit_bias"),
        ("logit-bias-101", CMPL, c(logit_bias={"5": 101}), 400, "logit_bias"),
        ("logit-bias-string", CMPL, c(logit_bias={"5": "up"}), 400, "logit_bias"),
        ("bad-words-not-text", CMPL, c(bad_words=["ok", 5]), 400, "bad_words"),
        ("bad-words-empty-word", CHAT, m(bad_words=["ok", ""]), 400, "bad_words"),
        ("bad-words-blank-word", CMPL, c(bad_words=[" \n"]), 400, "bad_words"),
        ("bad-words-not-a-list", CHAT, m(bad_words="ok"), 400, "bad_words"),
        # -- structured output --------------------------------------------------------------
        ("guided-regex-invalid", CMPL, c(guided_regex="(("), 400, "guided_regex"),
        ("guided-choice-empty", CMPL, c(guided_choice=[]), 400, "guided_choice"),
        ("guided-json-not-json", CMPL, c(guided_json="{nope"), 400, "guided_json"),
        ("guided-grammar-invalid", CMPL, c(guided_grammar="start: undefined_rule"), 400,
         "guided_grammar"),
        ("guided-grammar-bad-gbnf", CMPL, c(guided_grammar="root ::= foo"), 400,
         "guided_grammar"),
        ("guided-grammar-broken-gbnf", CMPL, c(guided_grammar="root ::= [a-"), 400,
         "guided_grammar"),
        ("prompt-batch-too-large", CMPL, c(prompt=[[1]] * 65, n=2), 400, "prompt"),
        ("chat-template-kwargs-break-the-template", CHAT,
         m(chat_template_kwargs={"tools": 5}), 400, "messages"),
        ("response-format-schema-missing", CHAT, m(response_format={
            "type": "json_schema", "json_schema": {"name": "x"}}), 400, "response_format"),
        ("response-format-schema-at-the-top", CHAT, m(response_format={
            "type": "json_schema", "schema": {"type": "object"}}), 400, "response_format"),
        ("chat-top-logprobs-without-logprobs", CHAT, m(top_logprobs=3), 400, "top_logprobs"),
        ("two-kinds-of-structure", CMPL, c(guided_regex="a", guided_choice=["b"]), 400,
         "one kind"),
        ("structured-outputs-unknown-key", CMPL, c(structured_outputs={"yaml": "x"}), 400,
         "structured_outputs"),
        ("response-format-bad-schema", CHAT, m(response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}), 400,
         "response_format"),
        ("response-format-schema-only-refers-to-itself", CHAT, m(response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}),
         400, "accepts no output"),
        ("guided-json-no-value-fits", CMPL, c(guided_json={
            "allOf": [{"type": "string"}, {"type": "integer"}]}), 400, "guided_json"),
        ("forced-tool-parameters-refer-to-themselves", CHAT, m(tools=[{
            "type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
            tool_choice={"type": "function", "function": {"name": "f"}}), 400, "tools"),
        ("best-of-below-n", CMPL, c(best_of=2, n=3), 400, "best_of"),
        ("best-of-streamed", CMPL, c(best_of=3, n=1, stream=True), 400, "best_of"),
        ("n-too-many", CMPL, c(n=129), 400, "n"),
        # -- model --------------------------------------------------------------------------
        ("model-missing", CMPL, {"prompt": "x"}, 400, "model"),
        ("model-int", CMPL, c(model=5), 400, "model"),
        ("model-null", CMPL, c(model=None), 400, "model"),
        ("model-unknown", CMPL, c(model="other"), 404, "model"),
        ("model-unknown-long-prompt", CMPL, c(model="other", prompt="y " * 50_000), 404,
         "model"),
        # -- prompt -------------------------------------------------------------------------
        ("prompt-missing", CMPL, {"model": model}, 400, "prompt"),
        ("prompt-null", CMPL, c(prompt=None), 400, "prompt"),
        ("prompt-int", CMPL, c(prompt=5), 400, "prompt"),
        ("prompt-dict", CMPL, c(prompt={"a": 1}), 400, "prompt"),
        ("prompt-empty-string", CMPL, c(prompt=""), 400, "prompt"),
        ("prompt-empty-list", CMPL, c(prompt=[]), 400, "prompt"),
        ("prompt-mixed-list", CMPL, c(prompt=[1, "a"]), 400, "prompt"),
        ("prompt-batch-with-an-empty-one", CMPL, c(prompt=["a", ""]), 400, "prompt"),
        ("prompt-batch-token-past-vocab", CMPL, c(prompt=[[1, 2], [99_999]]), 400, "prompt"),
        ("prompt-batch-mixed", CMPL, c(prompt=["a", [1]]), 400, "prompt"),
        ("prompt-negative-token", CMPL, c(prompt=[5, -1]), 400, "prompt"),
        ("prompt-token-past-vocab", CMPL, c(prompt=[1, 99_999]), 400, "prompt"),
        ("prompt-token-int32", CMPL, c(prompt=[2**31]), 400, "prompt"),
        ("prompt-token-2-40", CMPL, c(prompt=[big]), 400, "prompt"),
        ("prompt-token-2-70", CMPL, c(prompt=[2**70]), 400, "prompt"),
        ("prompt-token-float", CMPL, c(prompt=[1.5]), 400, "prompt"),
        ("prompt-token-bool", CMPL, c(prompt=[True]), 400, "prompt"),
        ("prompt-lone-surrogate", CMPL, b'{"model": "m", "prompt": "a\\ud800b"}', 400,
         "prompt"),
        ("prompt-too-long-tokens", CMPL, c(prompt=[5] * 5000), 400, "prompt"),
        ("prompt-too-long-text", CMPL, c(prompt="z" * 3_000_000), 400, "prompt"),
        ("suffix-int", CMPL, c(suffix=5), 400, "suffix"),
        ("echo-int", CMPL, c(echo=5), 400, "echo"),
        ("suffix-given", CMPL, c(suffix="return x"), 400, "suffix"),
        ("prompt-logprobs-21", CMPL, c(prompt_logprobs=21), 400, "prompt_logprobs"),
        ("prompt-logprobs-negative", CHAT, m(prompt_logprobs=-1), 400, "prompt_logprobs"),
        ("prompt-logprobs-streamed", CMPL, c(prompt_logprobs=1, stream=True), 400,
         "prompt_logprobs"),
        ("response-format-unknown", CMPL, c(response_format={"type": "yaml"}), 400,
         "response_format"),
        ("response-format-string", CMPL, c(response_format="json"), 400, "response_format"),
        ("logprobs-21", CMPL, c(logprobs=21), 400, "logprobs"),
        ("logprobs-negative", CMPL, c(logprobs=-1), 400, "logprobs"),
        ("logprobs-string", CMPL, c(logprobs="x"), 400, "logprobs"),
        # -- lengths ------------------------------------------------------------------------
        ("max-tokens-zero", CMPL, c(max_tokens=0), 400, "max_tokens"),
        ("max-tokens-negative", CMPL, c(max_tokens=-1), 400, "max_tokens"),
        ("max-tokens-1e12", CMPL, c(max_tokens=10**12), 400, "max_tokens"),
        ("max-tokens-2-64", CMPL, c(max_tokens=2**64), 400, "max_tokens"),
        ("max-tokens-string", CMPL, c(max_tokens="ten"), 400, "max_tokens"),
        ("max-tokens-float", CMPL, c(max_tokens=1.5), 400, "max_tokens"),
        ("max-tokens-list", CMPL, c(max_tokens=[1]), 400, "max_tokens"),
        ("min-tokens-negative", CMPL, c(min_tokens=-1), 400, "min_tokens"),
        ("min-tokens-2-40", CMPL, c(min_tokens=big), 400, "min_tokens"),
        ("min-tokens-over-max", CMPL, c(min_tokens=9, max_tokens=3), 400, "min_tokens"),
        ("max-tokens-past-the-context", CMPL, c(max_tokens=INT32_MAX), 400,
         "maximum context length"),
        ("chat-max-tokens-past-the-context", CHAT, m(max_completion_tokens=INT32_MAX), 400,
         "max_completion_tokens"),
        ("max-tokens-2-70", CMPL, c(max_tokens=2**70), 400, "max_tokens"),
        # -- sampling -----------------------------------------------------------------------
        ("temperature-negative", CMPL, c(temperature=-1), 400, "temperature"),
        ("temperature-string", CMPL, c(temperature="hot"), 400, "temperature"),
        ("temperature-list", CMPL, c(temperature=[1]), 400, "temperature"),
        ("top-p-zero", CMPL, c(top_p=0), 400, "top_p"),
        ("top-p-two", CMPL, c(top_p=2), 400, "top_p"),
        ("top-p-negative", CMPL, c(top_p=-0.5), 400, "top_p"),
        ("top-k-minus-2", CMPL, c(top_k=-2), 400, "top_k"),
        ("top-k-int32", CMPL, c(top_k=2**31), 400, "top_k"),
        ("top-k-2-40", CMPL, c(top_k=big), 400, "top_k"),
        ("top-k-float", CMPL, c(top_k=2.5), 400, "top_k"),
        ("min-p-two", CMPL, c(min_p=2), 400, "min_p"),
        ("min-p-negative", CMPL, c(min_p=-1), 400, "min_p"),
        ("repetition-penalty-zero", CMPL, c(repetition_penalty=0), 400,
         "repetition_penalty"),
        ("repetition-penalty-negative", CMPL, c(repetition_penalty=-1), 400,
         "repetition_penalty"),
        ("presence-penalty-3", CMPL, c(presence_penalty=3), 400, "presence_penalty"),
        ("frequency-penalty-minus-3", CMPL, c(frequency_penalty=-3), 400,
         "frequency_penalty"),
        ("n-zero", CMPL, c(n=0), 400, "n"),
        ("seed-2-64", CMPL, c(seed=2**64), 400, "seed"),
        ("seed-minus-2-64", CMPL, c(seed=-(2**64)), 400, "seed"),
        ("seed-string", CMPL, c(seed="abc"), 400, "seed"),
        ("seed-2-70", CMPL, c(seed=2**70), 400, "seed"),
        ("priority-2-70", CMPL, c(priority=2**70), 400, "priority"),
        ("seed-float", CMPL, c(seed=1.5), 400, "seed"),
        # -- stops --------------------------------------------------------------------------
        ("stop-int", CMPL, c(stop=5), 400, "stop"),
        ("stop-int-list", CMPL, c(stop=[1, 2]), 400, "stop"),
        ("stop-dict", CMPL, c(stop={"a": 1}), 400, "stop"),
        ("stop-lone-surrogate", CMPL, b'{"model": "m", "prompt": "x", "stop": ["\\udfff"]}',
         400, "stop"),
        ("stop-token-ids-negative", CMPL, c(stop_token_ids=[-1]), 400, "stop_token_ids"),
        ("stop-token-ids-2-40", CMPL, c(stop_token_ids=[big]), 400, "stop_token_ids"),
        ("stop-token-ids-string", CMPL, c(stop_token_ids="x"), 400, "stop_token_ids"),
        ("stop-token-ids-past-vocab", CMPL, c(stop_token_ids=[99_999]), 400,
         "stop_token_ids"),
        # -- flags and the rest -------------------------------------------------------------
        ("stream-string", CMPL, c(stream="maybe"), 400, "stream"),
        ("stream-options-string", CMPL, c(stream=True, stream_options="x"), 400,
         "stream_options"),
        ("ignore-eos-string", CMPL, c(ignore_eos="x"), 400, "ignore_eos"),
        ("skip-special-tokens-int", CMPL, c(skip_special_tokens=3), 400,
         "skip_special_tokens"),
        ("user-int", CMPL, c(user=5), 400, "user"),
        ("user-lone-surrogate", CMPL, b'{"model": "m", "prompt": "x", "user": "\\ud800"}', 400,
         "user"),
        ("priority-int32", CMPL, c(priority=2**31), 400, "priority"),
        ("priority-2-40", CMPL, c(priority=big), 400, "priority"),
        ("priority-string", CMPL, c(priority="high"), 400, "priority"),
        ("priority-float", CMPL, c(priority=1.5), 400, "priority"),
        # -- chat ---------------------------------------------------------------------------
        ("chat-messages-missing", CHAT, {"model": model}, 400, "messages"),
        ("chat-messages-null", CHAT, m(messages=None), 400, "messages"),
        ("chat-messages-empty", CHAT, m(messages=[]), 400, "messages"),
        ("chat-messages-string", CHAT, m(messages="hi"), 400, "messages"),
        ("chat-message-string", CHAT, m(messages=["hi"]), 400, "messages"),
        ("chat-role-missing", CHAT, m(messages=[{"content": "hi"}]), 400, "role"),
        ("chat-role-unknown", CHAT, m(messages=[{"role": "robot", "content": "hi"}]), 400,
         "role"),
        ("chat-content-int", CHAT, m(messages=[{"role": "user", "content": 5}]), 400,
         "content"),
        ("chat-content-part-int", CHAT, m(messages=[{"role": "user", "content": [1]}]), 400,
         "content"),
        ("chat-content-part-text-int", CHAT,
         m(messages=[{"role": "user", "content": [{"type": "text", "text": 123}]}]), 400,
         "content"),
        ("chat-content-image", CHAT, m(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]),
         400, "image_url"),
        ("chat-tool-call-without-function", CHAT, m(messages=[
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}]), 400,
         "tool_calls"),
        ("chat-continue-after-user", CHAT, m(continue_final_message=True,
                                             add_generation_prompt=False), 400,
         "continue_final_message"),
        ("chat-content-lone-surrogate", CHAT,
         b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
         "content"),
        ("chat-too-long", CHAT, m(messages=[{"role": "user", "content": "q " * 400_000}]),
         400, "messages"),
        ("chat-max-completion-tokens-zero", CHAT, m(max_completion_tokens=0), 400,
         "max_completion_tokens"),
        ("chat-max-completion-tokens-2-40", CHAT, m(max_completion_tokens=big), 400,
         "max_completion_tokens"),
        ("chat-top-logprobs-21", CHAT, m(logprobs=True, top_logprobs=21), 400,
         "top_logprobs"),
        ("chat-logprobs-string", CHAT, m(logprobs="x"), 400, "logprobs"),
        ("chat-add-generation-prompt-string", CHAT, m(add_generation_prompt="x"), 400,
         "add_generation_prompt"),
        ("chat-model-unknown", CHAT, m(model="other"), 404, "model"),
        ("chat-model-unknown-long", CHAT,
         m(model="other", messages=[{"role": "user", "content": "w " * 100_000}]), 404,
         "model"),
        ("chat-temperature-nan", CHAT,
         b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
         b'"temperature": NaN}', 400, "temperature"),
    ]


def cases(model: str) -> list[tuple[str, str, Any, int, str]]:
    """The corpus for a gateway serving ``model`` (byte bodies name the model "m"; the
    model's own name is put in where it matters)."""
    out = []
    for name, path, body, status, needle in _cases(model):
        if isinstance(body, bytes):
            body = body.replace(b'"model": "m"', b'"model": "' + model.encode() + b'"')
        out.append((name, path, body, status, needle))
    return out
