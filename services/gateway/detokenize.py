"""Incremental detokenization with stop strings.

Text is released only when it is final: a trailing incomplete UTF-8 sequence ("\\ufffd")
is held back, and so is any tail that could still grow into a stop string.
"""

from __future__ import annotations

from shared.models.tokenizer import Tokenizer


class IncrementalText:
    def __init__(self, tokenizer: Tokenizer, stops: list[str], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.stops = stops
        self.skip = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of text already released
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Take new tokens; return the text that became final (may be "")."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip)
        end = len(self.text)
        if self.text.endswith("\ufffd"):
            end -= 1
        for stop in self.stops:
            at = self.text.find(stop, max(0, self.sent - len(stop)))
            if at != -1:
                self.stopped = True
                end = min(end, at)
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
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out
