"""Reasoning parsers: split a model's output into its reasoning and its answer.

The reasoning sits between ``<think>`` and ``</think>``; the chat templates of these
models usually put ``<think>`` in the prompt, so the output often starts inside it.
One state machine serves both shapes (``extract`` runs a fresh one over the whole text):

    opening ──(optional <think>)──▶ reasoning ──</think>──▶ content
                                        └──an implicit end (a tool-call opener, left
                                           in the content for the tool parser)──┘

Text that may still grow into a marker is held back; at the end it is what it was read
as. No ``</think>`` at all means the whole output was reasoning (the generation was cut
off while thinking), as in vLLM. With thinking switched off everything is content. A
parser that is not ``forced`` (GLM-4.5's, Kimi's) reads reasoning only when the output
opens with its start marker; otherwise all of it is content.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import ClassVar

from pdmesh.services.gateway.parsers.tools import overlap


class Phase(Enum):
    OPENING = "opening"  # before the first character that is not "<think>" or space
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningParser:
    """``<think>``-style reasoning, base of the registered parsers (which set
    ``implicit_end``: a marker that ends reasoning without ``</think>``)."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    implicit_end: ClassVar[str | None] = None
    forced: ClassVar[bool] = True  # reasoning first, the start marker or not

    def __init__(self, thinking: bool = True):
        self.thinking = thinking
        self._phase = Phase.OPENING if thinking else Phase.CONTENT
        self._buf = ""
        self._implicit = self.implicit_end is not None  # still looking for it

    @property
    def in_opening(self) -> bool:
        return self._phase is Phase.OPENING

    @property
    def in_reasoning(self) -> bool:
        return self._phase is Phase.REASONING

    # -- the interface -------------------------------------------------------------------
    def extract(self, text: str) -> tuple[str | None, str | None]:
        machine = type(self)(self.thinking)
        reasoning, content = machine.feed(text)
        more_reasoning, more_content = machine.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        return self._step(final=True)

    # -- the machine ---------------------------------------------------------------------
    def _step(self, final: bool) -> tuple[str, str]:
        reasoning = ""
        if self._phase is Phase.OPENING:
            self._open(final)
        if self._phase is Phase.REASONING:
            reasoning = self._reason(final)
        content = ""
        if self._phase is Phase.CONTENT:
            content, self._buf = self._buf, ""
        return reasoning, content

    def _open(self, final: bool) -> None:
        """Drop a leading ``<think>`` (and space before it), as vLLM strips it."""
        head = self._buf.lstrip()
        if head.startswith(self.start):
            self._buf = head[len(self.start):]
            self._explicit_start()
        elif not final and self.start.startswith(head):
            return
        elif not self.forced:  # no start marker: no reasoning
            self._phase = Phase.CONTENT
            return
        self._phase = Phase.REASONING

    def _explicit_start(self) -> None:
        """The output opened its own ``<think>``."""

    def _reason(self, final: bool) -> str:
        out = []
        while True:
            marker, at = self._first_marker()
            if marker is None:
                keep = 0 if final else max(overlap(self._buf, m) for m in self._markers())
                out.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return "".join(out)
            out.append(self._buf[:at])
            rest = self._buf[at + len(marker):]
            if marker == self.end:
                self._buf, self._phase = rest, Phase.CONTENT
                return "".join(out)
            if marker == self.start:  # a stray <think> inside reasoning is dropped
                self._buf = rest
                self._explicit_start()
                continue
            verdict = self._confirm_implicit(rest, final)
            if verdict is None:  # cannot tell yet: hold the marker and what follows
                self._buf = self._buf[at:]
                return "".join(out)
            self._buf = self._buf[at:]
            if verdict:
                self._phase = Phase.CONTENT
                return "".join(out)
            self._implicit = False  # only the first one counts; it is reasoning text
            out.append(marker)
            self._buf = rest

    def _markers(self) -> list[str]:
        implicit = [self.implicit_end] if self._implicit and self.implicit_end else []
        return [self.end, self.start, *implicit]

    def _first_marker(self) -> tuple[str | None, int]:
        found = [(at, m) for m in self._markers() if (at := self._buf.find(m)) != -1]
        if not found:
            return None, -1
        at, marker = min(found)
        return marker, at

    def _confirm_implicit(self, after: str, final: bool) -> bool | None:
        """Whether the implicit end marker, followed by ``after``, ends the reasoning
        (None: not known until more text comes)."""
        return True


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: ``<think>`` optional (R1's template puts it in the prompt)."""

    name = "deepseek_r1"


class DeepSeekV3ReasoningParser(DeepSeekR1ReasoningParser):
    """DeepSeek-V3.1 / V3.2 (hybrid thinking): R1's rules when the request switches
    thinking on (``chat_template_kwargs``), else all content - vLLM's deepseek_v3."""

    name = "deepseek_v3"


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 / Qwen3.5: ``<think>`` optional, and a ``<tool_call>`` followed by
    ``<function=`` (Qwen3-Coder's call syntax) ends the reasoning when the model opens a
    call without closing its thinking first (vLLM 0.32 ends it at any ``<tool_call>``)."""

    name = "qwen3"
    implicit_end = "<tool_call>"
    _FUNCTION = "<function"
    _GENUINE = re.compile(r"<function[\s=]")

    def _confirm_implicit(self, after: str, final: bool) -> bool | None:
        head = after.lstrip()
        if self._GENUINE.match(head):
            return True
        if not final and self._FUNCTION.startswith(head[:len(self._FUNCTION)]) \
                and len(head) <= len(self._FUNCTION):
            return None
        return False


class DeepSeekV4ReasoningParser(ReasoningParser):
    """DeepSeek-V4 in thinking mode: R1's rules, and a DSML ``<｜DSML｜tool_calls>``
    ends the reasoning when ``</think>`` was skipped — unless the output opened its own
    ``<think>``, when only ``</think>`` counts (vLLM 0.32 ends it at the DSML
    marker even then)."""

    name = "deepseek_v4"
    implicit_end = "<｜DSML｜tool_calls>"

    def _explicit_start(self) -> None:
        self._implicit = False


class Glm45ReasoningParser(ReasoningParser):
    """GLM-4.5 / 4.6 (vLLM's and SGLang's glm45): reasoning only between a ``<think>``
    the output opens with and ``</think>``; an output without it is all content."""

    name = "glm45"
    forced = False


class KimiReasoningParser(ReasoningParser):
    """Kimi's thinking models (SGLang's kimi): ``◁think▷`` ... ``◁/think▷``, reasoning
    only when the output opens with the start marker."""

    name = "kimi"
    start = "◁think▷"
    end = "◁/think▷"
    forced = False


class Step3ReasoningParser(ReasoningParser):
    """StepFun's Step-3 (vLLM's and SGLang's step3): everything before ``</think>`` is
    reasoning (its template opens the thinking; the model writes no start marker)."""

    name = "step3"
