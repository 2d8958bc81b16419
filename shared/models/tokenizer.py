"""A model folder's tokenizer: tokenizer.json via the `tokenizers` library, and the chat
template from tokenizer_config.json rendered with jinja2 (as transformers renders it) -
or, with ``mode="deepseek_v4"`` (vLLM's ``--tokenizer-mode deepseek_v4``), chats encoded
by DeepSeek-V4's own message encoding (encoding_dsv4.py; V4 ships no template).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """Where chat templates render, as transformers renders them (sandboxed)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                              indent=indent)
    env.globals["raise_exception"] = _raise
    return env


# (hf, slow: as auto - one tokenizer here, tokenizer.json through `tokenizers`)
MODES = ("auto", "hf", "slow", "deepseek_v4")


def thinking_asked(kwargs: dict[str, Any] | None) -> bool | None:
    """A chat's thinking switch as its template kwargs give it (vLLM's keys): off with
    reasoning_effort "none", else "thinking" / "enable_thinking" (either true: on);
    None when they say nothing (the model's or the reasoning parser's default holds).
    The one place both the encoding and the gateway's reasoning parser read it from."""
    kwargs = kwargs or {}
    if kwargs.get("reasoning_effort") == "none":
        return False
    said = [bool(kwargs[k]) for k in ("thinking", "enable_thinking") if k in kwargs]
    return any(said) if said else None


def load_chat_template(value: str | None) -> str | None:
    """vLLM's ``--chat-template``: a file's path (read), or the template itself in one
    line (with ``{``, ``}`` or a newline in it; its escapes such as ``\\n`` read as
    characters). ValueError naming the flag for a path that cannot be read."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"--chat-template: {value!r} looks like a file's path, but it "
                             f"cannot be read ({e.strerror})") from None
    import codecs

    return codecs.decode(value, "unicode_escape")


class Tokenizer:
    def __init__(self, folder: str | Path, mode: str = "auto",
                 chat_template: str | None = None):
        """``chat_template``: a template in place of the checkpoint's (--chat-template)."""
        if mode not in MODES:
            raise ValueError(f"tokenizer mode: must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"model: {tok_file} not found (the tokenizer)")
        self.file = tok_file
        self._tok = _HFTokenizer.from_file(str(tok_file))
        cfg_file = folder / "tokenizer_config.json"
        self.config: dict[str, Any] = {}
        if cfg_file.is_file():
            with open(cfg_file) as f:
                self.config = json.load(f)
        self.chat_template: str | None = chat_template or self.config.get("chat_template")
        tmpl_file = folder / "chat_template.jinja"
        if self.chat_template is None and tmpl_file.is_file():
            self.chat_template = tmpl_file.read_text()
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos = bool(self.config.get("add_bos_token", False))
        self._template: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """At most how many characters of text one token stands for (None: no bound,
        a word-level model's unknown token takes a whole word). A byte-level vocabulary
        spells each byte as one character, and a character is at least one byte, so the
        longest vocabulary entry bounds it either way; added tokens are matched
        literally."""
        if type(self._tok.model).__name__ == "WordLevel":
            return None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return max((len(t) for t in vocab), default=1) or 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode holds it: a 900 kB prompt
        # stopped the gateway's event loop ~0.4 s from its tokenizing thread)
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_answer(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """An answer's text: an answer that ends inside a character (its bytes split over
        tokens, the last ones never generated) ends before it, as vLLM's detokenizer
        withholds the incomplete tail rather than sending U+FFFD."""
        end = len(ids)
        text = self.decode(ids, skip_special_tokens)
        while text.endswith("\ufffd") and end:
            end -= 1
            text = self.decode(ids[:end], skip_special_tokens)
        return text

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        continue_final_message: bool = False, chat_template: str | None = None,
        **kwargs: Any
    ) -> str:
        """The chat rendered as the model's template says (``chat_template``: a request's
        own, trusted by the caller). ``continue_final_message``: the text ends where the
        last (assistant) message's content ends, so the answer continues it
        (transformers' cut: what the template puts after it is dropped)."""
        if self.mode == "deepseek_v4" and chat_template is None:
            return self._encode_dsv4(messages, add_generation_prompt, continue_final_message,
                                     kwargs)
        text = self._render(messages, add_generation_prompt and not continue_final_message,
                            chat_template, **kwargs)
        if not continue_final_message:
            return text
        final = messages[-1].get("content") or ""
        if not isinstance(final, str) or final.strip() not in text:
            raise ValueError("messages: the chat template does not render the final "
                             "message's text, so it cannot be continued")
        final = final if final in text else final.strip()
        return text[:text.rindex(final) + len(final)]

    @staticmethod
    def _encode_dsv4(messages: list[dict[str, Any]], add_generation_prompt: bool,
                     continue_final_message: bool, kwargs: dict[str, Any]) -> str:
        """DeepSeek-V4's encoding, read with vLLM's keys: thinking switched by the
        template kwargs ``thinking`` / ``enable_thinking`` (on when they say nothing, as
        vLLM's deepseek_v4 mode has it), tools and reasoning_effort as the request
        gives them."""
        from pdmesh.shared.models.encoding_dsv4 import encode_messages

        asked = thinking_asked(kwargs)
        try:
            return encode_messages(
                messages, tools=kwargs.get("tools"), thinking=asked is None or asked,
                reasoning_effort=kwargs.get("reasoning_effort"),
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message)
        except ValueError as e:
            raise ValueError(f"messages: {e}") from None

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                chat_template: str | None = None, **kwargs: Any) -> str:
        if chat_template is not None:  # a request's own (compiled for it alone)
            try:
                template = _environment().from_string(chat_template)
            except jinja2.TemplateError as e:
                raise ValueError(f"chat_template: not a Jinja template: {e}") from None
        else:
            if not self.chat_template:
                raise ValueError("messages: this model's tokenizer has no chat template (a "
                                 "DeepSeek-V4 checkpoint's chats need --tokenizer-mode "
                                 "deepseek_v4, others --chat-template)")
            if self._template is None:
                self._template = _environment().from_string(self.chat_template)
            template = self._template
        reserved = ("messages", "add_generation_prompt", "bos_token", "eos_token")
        kwargs = {k: v for k, v in kwargs.items() if k not in reserved}
        try:
            return template.render(
                **kwargs,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError,
                IndexError) as e:  # raise_exception(...), or what the template could not use
            raise ValueError(f"messages: the chat template refused them: {e}") from None


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):  # {"content": "<s>", ...} in older configs
        return tok.get("content")
    return tok
