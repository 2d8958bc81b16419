"""The tiny models' tokenizers: a byte-level BPE trained on this Python's standard-library
sources, with a model family's special and markup tokens (``TokenizerSpec``), and the
tokenizer_config.json / special_tokens_map.json its checkpoints ship."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pdmesh.shared.models import encoding_dsv4 as dsv4
from pdmesh.shared.models.corpus import corpus_files

# Qwen3's chat format, compactly: tools in the system turn, calls as <tool_call> JSON,
# results as <tool_response> user turns, reasoning in <think>, enable_thinking=False as
# an empty <think> block opening the answer
CHAT_TEMPLATE = (
    "{% set ns = namespace(system='') %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set ns.system = messages[0]['content'] %}{% endif %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}{% if ns.system %}{{ ns.system + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{% elif ns.system %}{{ '<|im_start|>system\n' + ns.system + '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + "
    "'\n</tool_response><|im_end|>\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% if message.get('reasoning_content') %}"
    "{{ '<think>\n' + message['reasoning_content'] + '\n</think>\n\n' }}{% endif %}"
    "{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' + "
    "(call['function']['arguments'] | tojson) + '}\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)


@dataclass(frozen=True)
class TokenizerSpec:
    """A model family's tokenizer: the tokens matched whole, and what its config says.
    ``special`` tokens are dropped from text by skip_special_tokens; ``markup`` tokens
    are matched whole but stay text (the reasoning and tool-call parsers read them)."""

    special: tuple[str, ...]
    markup: tuple[str, ...]
    bos: str
    eos: str
    pad: str
    add_bos: bool
    chat_template: str | None  # None: the family ships none (DeepSeek-V4's encoding)


QWEN_TOKENS = TokenizerSpec(
    special=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"), markup=(),
    bos="<|endoftext|>", eos="<|im_end|>", pad="<|pad|>", add_bos=False,
    chat_template=CHAT_TEMPLATE)
# DeepSeek-V4's: BOS / EOS / pad special, the chat and tool-call markup whole tokens that
# decode as text; no chat template (--tokenizer-mode deepseek_v4 renders chats)
DSV4_TOKENS = TokenizerSpec(
    special=(dsv4.BOS, dsv4.EOS, "<｜▁pad▁｜>"),
    markup=(dsv4.USER, dsv4.ASSISTANT, dsv4.LATEST_REMINDER, dsv4.THINK_START,
            dsv4.THINK_END, dsv4.DSML, *dsv4.TASK_TOKENS.values()),
    bos=dsv4.BOS, eos=dsv4.EOS, pad="<｜▁pad▁｜>", add_bos=True, chat_template=None)


def tokenizer_spec(arch: str) -> TokenizerSpec:
    return DSV4_TOKENS if arch == "deepseek_v4" else QWEN_TOKENS


def train_tokenizer(vocab_size: int, spec: TokenizerSpec = QWEN_TOKENS) -> Tokenizer:
    """Byte-level BPE (GPT-2 / Qwen style) trained on standard-library sources, with
    ``spec``'s special tokens first and its markup tokens last."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(spec.markup),
        min_frequency=2,
        special_tokens=list(spec.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(corpus_files(), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.markup])
    return tok


def check_tokenizer(tok: Tokenizer, spec: TokenizerSpec, arch: str) -> None:
    missing = [t for t in (*spec.special, *spec.markup) if tok.token_to_id(t) is None]
    if missing:
        raise ValueError(f"tokenizer: lacks {arch}'s tokens {missing} (train one with "
                         f"train_tokenizer(vocab, tokenizer_spec({arch!r})))")


def tokenizer_config_files(spec: TokenizerSpec, max_len: int) -> dict[str, dict]:
    """tokenizer_config.json and special_tokens_map.json as the family's checkpoints write
    them (the chat template inside the config, when the family has one): name -> JSON."""
    extra = [t for t in spec.special if t not in (spec.bos, spec.eos, spec.pad)]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": spec.bos,
              "eos_token": spec.eos, "pad_token": spec.pad, "unk_token": None,
              "additional_special_tokens": extra, "add_bos_token": spec.add_bos,
              "model_max_length": max_len,
              "clean_up_tokenization_spaces": False}
    if spec.chat_template is not None:
        config["chat_template"] = spec.chat_template
    return {"tokenizer_config.json": config,
            "special_tokens_map.json": {"bos_token": spec.bos, "eos_token": spec.eos,
                                        "pad_token": spec.pad,
                                        "additional_special_tokens": extra}}
