"""SGLang's speculative flags, read by every command that takes them (the services,
`pdmesh serve`, `pdmesh sglang`, `config check`) into vLLM's --speculative-config:

    --speculative-algorithm NGRAM   drafts --speculative-num-draft-tokens - 1 tokens
                                    (SGLang counts the verified token too) within the
                                    --speculative-ngram-{min,max}-match-window-size
    --speculative-algorithm NEXTN   DeepSeek's MTP, --speculative-num-steps drafts
    EAGLE, EAGLE3, STANDALONE       their vLLM methods, the draft model
                                    --speculative-draft-model-path

Without --speculative-algorithm the others do nothing, and say so; a line that gives
--speculative-config itself keeps it (SGLang's flags are then said to be without
effect).
"""

from __future__ import annotations

import copy
from typing import Any

METHODS = {"NGRAM": "ngram", "NEXTN": "deepseek_mtp", "EAGLE": "eagle", "EAGLE3": "eagle3",
           "STANDALONE": "draft_model"}
# the flags read here, by attribute (their canonical spelling: "--" + dashes)
READ = ("speculative_num_draft_tokens", "speculative_num_steps",
        "speculative_draft_model_path", "speculative_ngram_min_match_window_size",
        "speculative_ngram_max_match_window_size")


def _spelled(attr: str) -> str:
    return "--" + attr.replace("_", "-")


def read_sglang_speculative(flags: Any) -> tuple[Any, list[str]]:
    """(``flags`` with SGLang's speculative flags read into --speculative-config, what
    to say); ValueError naming the flag. ``flags`` is left as it was."""
    if not hasattr(flags, "speculative_algorithm"):
        return flags, []
    given = [a for a in READ if getattr(flags, a, None) is not None]
    algorithm = flags.speculative_algorithm
    if algorithm is None:
        return flags, [f"{_spelled(a)}: without effect (read with --speculative-algorithm)"
                       for a in given]
    if flags.speculative_config is not None:
        return flags, [f"{_spelled(a)}: without effect (--speculative-config is given)"
                       for a in ("speculative_algorithm", *given)]
    spec, used = speculative_config(flags)
    out = copy.copy(flags)
    out.speculative_config = spec
    return out, [f"{_spelled(a)}: without effect with {algorithm}" for a in given
                 if a not in used]


def speculative_config(flags: Any) -> tuple[dict[str, Any], set[str]]:
    """vLLM's --speculative-config for the line's SGLang flags, and those it read."""
    algorithm = flags.speculative_algorithm
    method = METHODS.get(str(algorithm).upper())
    if method is None:
        raise ValueError(f"--speculative-algorithm: one of {', '.join(METHODS)}, got "
                         f"{algorithm!r}")
    if method == "ngram":
        draft = flags.speculative_num_draft_tokens
        if draft is not None and draft < 2:
            raise ValueError(f"--speculative-num-draft-tokens: at least 2 with NGRAM (SGLang "
                             f"counts the verified token too), got {draft}")
        spec: dict[str, Any] = {"method": "ngram",
                                "num_speculative_tokens": 3 if draft is None else draft - 1}
        windows = {"speculative_ngram_min_match_window_size": "prompt_lookup_min",
                   "speculative_ngram_max_match_window_size": "prompt_lookup_max"}
        spec.update({key: getattr(flags, a) for a, key in windows.items()
                     if getattr(flags, a) is not None})
        return spec, {"speculative_num_draft_tokens", *windows}
    spec = {"method": method, "num_speculative_tokens": flags.speculative_num_steps or 1}
    used = {"speculative_num_steps"}
    if method != "deepseek_mtp" and flags.speculative_draft_model_path is not None:
        spec["model"] = flags.speculative_draft_model_path
        used.add("speculative_draft_model_path")
    return spec, used
