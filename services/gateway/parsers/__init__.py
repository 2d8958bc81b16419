"""Output parsers of the gateway, chosen by name as vLLM's --tool-call-parser and
--reasoning-parser are: tool-call parsers turn call markup in the model's text into
OpenAI ``tool_calls``; reasoning parsers split ``reasoning`` from ``content``.
Both work on a whole output (``extract``) and on a stream (``feed`` then ``finish``), and
a parser instance serves one request.
"""

from __future__ import annotations

from typing import Any

from pdmesh.services.gateway.parsers.deepseek import (
    DeepSeekV3ToolParser,
    DeepSeekV4ToolParser,
    DeepSeekV31ToolParser,
    coerce_to_schema,
    schema_types,
)
from pdmesh.services.gateway.parsers.llama3 import Llama3JsonToolParser
from pdmesh.services.gateway.parsers.qwen3_coder import Qwen3CoderToolParser, qwen3_coder_value
from pdmesh.services.gateway.parsers.reasoning import (
    DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser,
    DeepSeekV4ReasoningParser,
    Glm45ReasoningParser,
    KimiReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    Step3ReasoningParser,
)
from pdmesh.services.gateway.parsers.tools import (
    CanonicalJSON,
    HermesToolParser,
    ToolCall,
    ToolParser,
    call_id,
    overlap,
)
from pdmesh.shared.models.tokenizer import thinking_asked

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesToolParser, Qwen3CoderToolParser, DeepSeekV3ToolParser, DeepSeekV31ToolParser,
    DeepSeekV4ToolParser, Llama3JsonToolParser)}
TOOL_PARSERS["llama3"] = Llama3JsonToolParser  # SGLang's name for llama3_json
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (
    DeepSeekR1ReasoningParser, DeepSeekV3ReasoningParser, Qwen3ReasoningParser,
    DeepSeekV4ReasoningParser, Glm45ReasoningParser, KimiReasoningParser,
    Step3ReasoningParser)}

# Whether thinking is on when chat_template_kwargs say nothing, as vLLM 0.32 takes it:
# Qwen3 and DeepSeek-V4 think unless told not to (V4's encoding defaults to it too).
_THINKING_DEFAULT = {"deepseek_r1": True, "qwen3": True, "deepseek_v3": False,
                     "deepseek_v4": True, "glm45": True, "kimi": True, "step3": True}


def _known(kind: str, name: str, registry: dict[str, Any]) -> None:
    if name not in registry:
        raise ValueError(f"unknown {kind} parser {name!r}; known: {', '.join(sorted(registry))}")


def tool_parser(name: str, tools: list[dict] | None) -> ToolParser:
    _known("tool-call", name, TOOL_PARSERS)
    return TOOL_PARSERS[name](tools)


def reasoning_parser(name: str, thinking: bool = True) -> ReasoningParser:
    _known("reasoning", name, REASONING_PARSERS)
    return REASONING_PARSERS[name](thinking)


def thinking_enabled(name: str, chat_template_kwargs: dict[str, Any] | None) -> bool:
    """Whether a request thinks: what its template kwargs say (``thinking_asked``),
    else the parser's default (see ``_THINKING_DEFAULT``)."""
    asked = thinking_asked(chat_template_kwargs)
    return _THINKING_DEFAULT.get(name, True) if asked is None else asked


__all__ = [
    "REASONING_PARSERS", "TOOL_PARSERS", "CanonicalJSON", "DeepSeekR1ReasoningParser",
    "DeepSeekV3ToolParser", "DeepSeekV4ReasoningParser", "DeepSeekV4ToolParser",
    "DeepSeekV31ToolParser", "HermesToolParser", "Llama3JsonToolParser",
    "Qwen3CoderToolParser", "Qwen3ReasoningParser", "ReasoningParser", "ToolCall",
    "ToolParser", "call_id", "coerce_to_schema", "overlap", "qwen3_coder_value",
    "reasoning_parser", "schema_types", "thinking_enabled", "tool_parser",
]
