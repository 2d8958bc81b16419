"""Per-request sampling parameters, named and validated as vLLM's ``SamplingParams``."""

from __future__ import annotations

from dataclasses import dataclass, field

SAMPLING_EPS = 1e-5  # temperatures below this are greedy
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (plus the sampled one)
    skip_special_tokens: bool = True
    # structured output: an llguidance grammar (engine/structured.py) the output obeys
    grammar: str | None = None
    # the grammar binds only the output after this text (what closes the model's
    # reasoning, e.g. "</think>": vLLM applies structured output after reasoning)
    grammar_after: str | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added logit
    # vLLM's bad_words as token ids: a word's last token is banned wherever the output
    # ends with the tokens before it (a one-token word: always)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # top-n logprobs per prompt token (plus the prompt's own), computed where the prompt
    # is: such a prompt takes no prefix-cache or pool hits
    prompt_logprobs: int | None = None
    # SGLang's: the answer carries the final (normed) hidden state of the last token fed
    # to the model, once it has been fed more than its prompt (engine/hidden_states.py)
    return_hidden_states: bool = False

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids or []]
        self.validate()
        if self.is_greedy:
            # As vLLM does: greedy ignores the truncation knobs.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing else to compute: no penalties, logprobs or min_tokens."""
        return (self.temperature < SAMPLING_EPS and self.logprobs is None
                and not self.min_tokens and not self.has_penalties and not self.logit_bias
                and not self.bad_words_token_ids)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def validate(self) -> None:
        """ValueError naming the first field out of range."""
        if self.n != 1:
            raise ValueError(f"n: only n=1 is supported, got {self.n}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k: must be -1, 0 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty: must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(
                f"frequency_penalty: must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens: must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs: must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs: must be in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0
               or not -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()):
            raise ValueError(f"logit_bias: token ids must be non-negative integers and "
                             f"biases in [-100, 100], got {self.logit_bias}")
        if any(not word or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                               for t in word) for word in self.bad_words_token_ids):
            raise ValueError(f"bad_words: each word must be a non-empty list of "
                             f"non-negative token ids, got {self.bad_words_token_ids}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("grammar: must be a grammar's text")
        if self.grammar_after is not None and (self.grammar is None or not isinstance(
                self.grammar_after, str) or not self.grammar_after):
            raise ValueError(f"grammar_after: must be a non-empty text, with a grammar; "
                             f"got {self.grammar_after!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: must be non-negative integers, "
                             f"got {self.stop_token_ids}")
