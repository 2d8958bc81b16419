"""The OpenAI request bodies the gateway accepts, validated field by field.

pydantic does the typing; ``to_sampling`` turns a request into the engine's
SamplingParams, whose own checks name the field on a bad value. vLLM's extensions
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, priority)
are accepted too, as vLLM's OpenAI server accepts them. Every integer is bounded by the
protobuf field it travels in (a value past it is a 400 here, not a failure on the way),
and no float may be infinite or NaN.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from pdmesh.shared.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
INT64 = 2**63
Int32 = Annotated[int, Field(ge=-(2**31), le=INT32_MAX)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]  # not a bool
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]  # a number of tokens
MAX_CHOICES = 128  # n, best_of: at most (each choice is a request in the mesh)
COMPLETION_MAX_TOKENS = 16  # a completion's max_tokens when none is given (vLLM's, OpenAI's)

# accepted as OpenAI's clients send them, without effect here (one warning per name)
WITHOUT_EFFECT = ("user", "metadata", "store", "service_tier", "guided_decoding_backend",
                  "guided_whitespace_pattern")
_warned: set[str] = set()  # field names warned about, once per process


def warn_once(names: list[str], why: str) -> None:
    """One warning per field name for the life of the process, as vLLM warns of the
    fields it ignores (a request per second would otherwise flood the log)."""
    new = sorted(n for n in names if n not in _warned)
    if new:
        _warned.update(new)
        log.warning("request fields %s: %s", ", ".join(new), why)


@dataclass(frozen=True)
class Shape:
    """How the request asked its answer written (vLLM's extensions)."""

    include_stop_str: bool = False  # include_stop_str_in_output
    token_ids_as_text: bool = False  # return_tokens_as_token_ids: "token_id:N" tokens
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    token_ids: bool = False  # return_token_ids: the prompt's and the answer's token ids
    prompt_text: bool = False  # return_prompt_text: the chat's rendered prompt


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of these."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


class _Base(BaseModel):
    # an unknown field is accepted and ignored (warned of once), as vLLM does
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """An explicit null stands for the field's default, as vLLM reads it (``"n":
        null``, ``"stream": null``, the penalties); a required field sent as null is
        still missing (a 400 naming it)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].default is None}

    @model_validator(mode="after")
    def _warn_of_ignored(self) -> _Base:
        if self.model_extra:
            warn_once(list(self.model_extra), "not known here, ignored")
        fields = type(self).model_fields
        given = [n for n in WITHOUT_EFFECT if n in fields and getattr(self, n) is not None]
        if given:
            warn_once(given, "accepted, without effect")
        return self

    model: str
    # SGLang's: the LoRA adapter to run, by its name or folder (over ``model``'s)
    lora_path: str | None = None
    # the LoRA adapter it runs, (name, folder), as the gateway found it on admission
    # (None: the base model)
    _adapter: tuple[str, str] | None = PrivateAttr(default=None)
    max_tokens: Count | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM extensions
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False  # the prompt's and the answer's token ids with the text
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    # None: the engine's --default-priority-value (0 unless set); int32 on the wire
    priority: Int32 | None = None
    # SGLang's: the last token fed's final hidden state in the answer (a server started
    # with --enable-return-hidden-states)
    return_hidden_states: bool = False

    # structured output (constraints.py makes the grammar), and the bias on the logits
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # (one grammar engine here: llguidance)
    guided_whitespace_pattern: str | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    bad_words: list[str] | None = None  # vLLM's: never generated (constraints.py)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # top-n per prompt token
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)

    @field_validator("bad_words")
    @classmethod
    def _no_blank_bad_word(cls, words: list[str] | None) -> list[str] | None:
        blank = next((i for i, w in enumerate(words or ()) if not w.strip()), None)
        if blank is not None:  # (vLLM fails on one: it has no tokens to ban)
            raise ValueError(f"word {blank} is empty: a bad word needs text")
        return words

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> _Base:
        if self.prompt_logprobs and self.stream:  # (vLLM's refusal: 0 asks for none)
            raise ValueError("prompt_logprobs: not available when stream is true")
        return self

    @model_validator(mode="after")
    def _best_of_n(self) -> _Base:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of: must be >= n ({self.n}), got {self.best_of}")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of: more candidates than n cannot be streamed (which "
                             "are answered is known only at the end)")
        return self

    def shape(self) -> Shape:
        usage = self.stream_options or {}
        return Shape(self.include_stop_str_in_output, self.return_tokens_as_token_ids,
                     bool(usage.get("include_usage") and usage.get("continuous_usage_stats")),
                     self.return_token_ids)

    def truncated(self, prompt: list[int], context: int) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens (-1: as many as the context
        holds), as vLLM cuts it; the prompt itself when none is asked."""
        keep = self.truncate_prompt_tokens
        if keep is None or keep == 0:
            return prompt
        keep = context if keep == -1 else keep
        return prompt[-keep:]

    def choices_generated(self) -> int:
        """How many answers are generated: best_of's candidates, else n."""
        return self.best_of or self.n

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    def top_logprobs_n(self) -> int | None:
        return None

    def prompt_logprobs_n(self) -> int | None:
        return self.prompt_logprobs

    def to_sampling(self, room: int, defaults: dict[str, Any] | None = None
                    ) -> SamplingParams:
        """The engine's parameters; ``room``: the tokens the context has left, which a
        default max_tokens is cut to (one asked for past it is refused before this);
        ``defaults``: what a field the request leaves out takes (the model's generation
        config, as vLLM serves it: shared/engine/generation_defaults.py)."""
        d = defaults or {}

        def given(value: Any, name: str, fallback: Any) -> Any:
            return value if value is not None else d.get(name, fallback)

        return SamplingParams(
            temperature=given(self.temperature, "temperature", 1.0),
            top_p=given(self.top_p, "top_p", 1.0),
            top_k=given(self.top_k, "top_k", 0), min_p=given(self.min_p, "min_p", 0.0),
            seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=given(self.repetition_penalty, "repetition_penalty", 1.0),
            stop_token_ids=self.stop_token_ids or [],
            # (vLLM's get_max_tokens: the least of what is asked, the room left and the
            # generation config's max_new_tokens, which caps an asked one too)
            max_tokens=min(v for v in (self.effective_max_tokens() or room, room,
                                       d.get("max_tokens")) if v is not None),
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            logprobs=self.top_logprobs_n(), skip_special_tokens=self.skip_special_tokens,
            prompt_logprobs=self.prompt_logprobs_n(),
            return_hidden_states=self.return_hidden_states)

    def effective_max_tokens(self) -> int | None:
        return self.max_tokens

    def asked_max_tokens(self) -> tuple[str, int] | None:
        """The output length the client asked for, and the field it asked in (None:
        none asked)."""
        return None if self.max_tokens is None else ("max_tokens", self.max_tokens)


class CompletionRequest(_Base):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # a completion's prompt gets the BOS its model wants

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:  # refused, not dropped: the answer would not be what was asked
            raise ValueError("not served (no fill-in-the-middle model is served here)")
        return suffix

    def top_logprobs_n(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_n(self) -> int | None:
        """As asked; else, echoing with logprobs, as many as logprobs (the echoed
        prompt's tokens get theirs from the prompt's, as vLLM gives them)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def effective_max_tokens(self) -> int | None:
        """As asked; none asked, or an explicit null: 16 (OpenAI's default for the
        field; vLLM 0.32 reads an explicit null as "as many as fit" - see
        docs/vllm-crosscheck.md)."""
        return COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    """An assistant message's earlier tool call, as the client sends it back."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    # "function": the legacy role of a function's result (older agent frameworks), read
    # as a tool message
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # (earlier vLLM's, SGLang's, DeepSeek's name)
    reasoning: str | None = None  # (vLLM 0.32's)

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """Text parts only: no multimodal model is served here, and a part dropped
        silently would change the question."""
        if not isinstance(content, list):
            return content
        for i, part in enumerate(content):
            kind = part.get("type")
            if kind not in ("text", "input_text"):
                raise ValueError(f"part {i} is of type {kind!r}: only text parts are "
                                 f"served (no multimodal model is served here)")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: text must be a string")
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text content; an earlier call's
        arguments as a mapping (templates iterate them, as vLLM hands them over)."""
        out: dict[str, Any] = {"role": "tool" if self.role == "function" else self.role,
                               "content": self.text()}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:  # (templates read either name)
            out["reasoning_content"] = out["reasoning"] = reasoning
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _as_mapping(c.function.arguments)}}
                for c in self.tool_calls]
        return out


# what the request's own fields decide, never its chat_template_kwargs
_RESERVED_KWARGS = frozenset({"messages", "add_generation_prompt", "continue_final_message",
                              "bos_token", "eos_token"})


def template_kwargs(given: dict[str, Any] | None) -> dict[str, Any]:
    """A request's chat_template_kwargs, less the names its own fields set."""
    return {k: v for k, v in (given or {}).items() if k not in _RESERVED_KWARGS}


def chat_kwargs(body: Any) -> dict[str, Any]:
    """What ``body``'s chat template reads besides its messages and tools: its
    chat_template_kwargs, then its reasoning_effort over theirs, which also switches
    thinking (``enable_thinking``: off for "none") unless they set enable_thinking - as
    vLLM merges them."""
    kwargs = template_kwargs(body.chat_template_kwargs)
    effort = getattr(body, "reasoning_effort", None)
    if effort is not None:
        kwargs["reasoning_effort"] = effort
        kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs


def render_chat(tokenizer: Any, body: Any, trust_request_template: bool = False) -> str:
    """The prompt text of ``body``'s chat (a chat completion or a tokenize request): its
    messages through the chat template with its tools, chat_template_kwargs and
    reasoning_effort, as vLLM renders them. A template the request brings (its
    ``chat_template``, or one in its chat_template_kwargs) renders it only when the
    gateway trusts them (--trust-request-chat-template), as vLLM refuses it otherwise.
    ValueError when the template refuses them (or is refused: the message then begins
    with "chat_template")."""
    kwargs = chat_kwargs(body)
    own = body.chat_template if body.chat_template is not None else kwargs.pop(
        "chat_template", None)
    kwargs.pop("chat_template", None)
    if own is not None and not trust_request_template:
        raise ValueError("chat_template: passed with the request, but the server was not "
                         "started with --trust-request-chat-template (an untrusted "
                         "template is refused)")
    if own is not None and not isinstance(own, str):
        raise ValueError("chat_template: must be a string (a Jinja template)")
    if body.tools:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    return tokenizer.apply_chat_template(
        [m.for_template() for m in body.messages],
        add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
        continue_final_message=body.continue_final_message, chat_template=own, **kwargs)


def _as_mapping(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: the template gets the text as it came


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (None: no parameters)
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(_Base):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # False: the first call only
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template puts them where they go
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # a template of its own (--trust-request-chat-template)
    reasoning_effort: str | None = None  # to the chat template, which may read it
    return_prompt_text: bool = False  # the prompt as the chat template rendered it
    # False: the reasoning is not sent (with a reasoning parser: nor the answer's logprobs
    # and token ids, which would show it), and a grammar binds from the first token
    include_reasoning: bool = True

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto"):
            return self
        if not self.tools:
            raise ValueError("tool_choice: needs tools to choose from")
        names = [t.function.name for t in self.tools]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: {choice.function.name!r} is not one of the "
                             f"tools ({', '.join(names)})")
        return self

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """As given; not given: "auto" when there are tools, else "none" (vLLM)."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @model_validator(mode="after")
    def _one_way_to_end(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt \
                and "add_generation_prompt" in self.model_fields_set:
            raise ValueError("continue_final_message: cannot be set with "
                             "add_generation_prompt (the answer either continues the last "
                             "message or starts a new one)")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be the "
                             "assistant's")
        return self

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true (as OpenAI and vLLM "
                             "read it)")
        return self

    def top_logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def shape(self) -> Shape:
        return dataclasses.replace(super().shape(), prompt_text=self.return_prompt_text)

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def asked_max_tokens(self) -> tuple[str, int] | None:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super().asked_max_tokens()
