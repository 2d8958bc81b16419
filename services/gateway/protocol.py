"""The OpenAI request bodies the gateway accepts, validated field by field.

pydantic does the typing; ``to_sampling`` turns a request into the engine's
SamplingParams, whose own checks name the field on a bad value. vLLM's extensions
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, priority)
are accepted too, as vLLM's OpenAI server accepts them. Every integer is bounded by the
protobuf field it travels in (a value past it is a 400 here, not a failure on the way),
and no float may be infinite or NaN.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdmesh.shared.engine.sampling_params import SamplingParams

INT32_MAX = 2**31 - 1
INT64 = 2**63
Int32 = Annotated[int, Field(ge=-(2**31), le=INT32_MAX)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]  # not a bool
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]  # a number of tokens


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

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

    model: str
    max_tokens: Count | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    # vLLM extensions
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    # None: the engine's --default-priority-value (0 unless set); int32 on the wire
    priority: Int32 | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    def top_logprobs_n(self) -> int | None:
        return None

    def to_sampling(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, min_p=self.min_p or 0.0, seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty or 1.0,
            stop_token_ids=self.stop_token_ids or [],
            max_tokens=self.effective_max_tokens() or default_max_tokens,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            logprobs=self.top_logprobs_n(), skip_special_tokens=self.skip_special_tokens)

    def effective_max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_Base):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    def top_logprobs_n(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content
                       if part.get("type") == "text")


class ChatCompletionRequest(_Base):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True

    def top_logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
