"""Incremental detokenization with stop strings.

Text is released only when it is final: a trailing incomplete UTF-8 sequence ("\\ufffd")
is held back (and never sent when generation ends inside it, as vLLM), and so is any tail
that could still grow into a stop string.

Each step decodes a short window, not the whole output (which made a request's
detokenization quadratic in its length): the text of ``ids[prefix:]`` minus that of
``ids[prefix:read]``, where ``read`` is where the last released text ended and
``prefix`` a few tokens before it, so that decoders which strip a leading space or
merge bytes across tokens see the same context as a full decode would.
"""

from __future__ import annotations

from pdmesh.shared.models.tokenizer import Tokenizer


class IncrementalText:
    def __init__(self, tokenizer: Tokenizer, stops: list[str], skip_special_tokens: bool,
                 include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stops = stops
        self.skip = skip_special_tokens
        self.include_stop = include_stop  # the stop string ends the text, not cut off
        self.stop_string: str | None = None  # the one that ended it
        self.token_ids: list[int] = []
        self.text = ""  # everything decoded so far (complete characters)
        self.sent = 0  # characters of text already released
        self.stopped = False
        self._prefix = 0  # the decode window: ids[_prefix:], of which ids[_prefix:_read]
        self._read = 0    # were decoded before (text ``_prefix_text``)
        self._prefix_text = ""

    def add(self, token_ids: list[int]) -> str:
        """Take new tokens; return the text that became final (may be "")."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        self.text += self._decoded(final=False)
        return self._release(len(self.text))

    def _decoded(self, final: bool) -> str:
        """Text the tokens since ``_read`` add; "" while they end inside a character
        (``final``: the text of the longest run of them that does not, as vLLM's: an
        answer cut inside a character ends before it)."""
        ids = self.token_ids
        end = len(ids)
        window = self.tokenizer.decode(ids[self._prefix:], skip_special_tokens=self.skip)
        while final and window.endswith("\ufffd") and end > self._read:
            end -= 1  # (a character is at most 4 bytes: a few tokens back at most)
            window = self.tokenizer.decode(ids[self._prefix:end], skip_special_tokens=self.skip)
        if len(window) <= len(self._prefix_text) or window.endswith("\ufffd"):
            return ""
        new = window[len(self._prefix_text):]
        self._prefix, self._read = self._read, end
        self._prefix_text = self.tokenizer.decode(ids[self._prefix:self._read],
                                                  skip_special_tokens=self.skip)
        return new

    def _release(self, end: int) -> str:
        found = [(at, stop) for stop in self.stops
                 if (at := self.text.find(stop, max(0, self.sent - len(stop)))) != -1]
        if found:
            at, stop = min(found)  # the first to occur
            self.stopped, self.stop_string = True, stop
            end = min(end, at + (len(stop) if self.include_stop else 0))
        if not self.stopped and self.stops:
            hold = max((k for s in self.stops for k in range(1, len(s))
                        if self.text[:end].endswith(s[:k])), default=0)
            end -= hold
        end = max(end, self.sent)
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def flush(self) -> str:
        """At the end of generation: whatever was held back and is not a stop string."""
        if self.stopped:
            return ""
        self.text += self._decoded(final=True)
        out = self._release(len(self.text))  # a stop string may sit in the last tokens
        if self.stopped:
            return out
        out += self.text[self.sent:]
        self.sent = len(self.text)
        return out
