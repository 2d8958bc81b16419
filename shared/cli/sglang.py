"""`pdmesh sglang`: SGLang's `launch_server` command line, as the seeds write it.

    pdmesh sglang --model-path M [--tp-size 1 --mem-fraction-static 0.8 ...]
        -> one mixed instance behind the OpenAI gateway (`pdmesh serve`), on SGLang's
           port 30000 unless --port says otherwise
    pdmesh sglang --model-path M --disaggregation-mode prefill|decode \\
                  --disaggregation-transfer-backend mooncake --kvstore HOST:PORT ...
        -> a prefill or decode instance of the mesh (`pdmesh prefill` / `decode`); where
           SGLang's router (`sglang_router.launch_router --pd-disaggregation`) would
           stand, `pdmesh gateway` routes over the registry

The line is rewritten into that command's and read by the one flag table: the flags
pdmesh implements take effect under their SGLang names, the others are listed at
start-up as without effect, and a misspelt one gets a did-you-mean.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

MODES = {"null": "serve", "prefill": "prefill", "decode": "decode"}
BACKENDS = ("mooncake", "ascend")  # both run as pdmesh's Mooncake pool
SGLANG_PORT = "30000"


def translate(words: list[str]) -> tuple[list[str], list[str]]:
    """(the pdmesh command line, warnings) for SGLang's ``words``. ValueError naming the
    flag for a value pdmesh cannot run."""
    rest: list[str] = []
    taken: dict[str, str] = {}
    i = 0
    while i < len(words):
        word = words[i]
        name, eq, value = word.partition("=")
        if name in ("--disaggregation-mode", "--disaggregation-transfer-backend",
                    "--disaggregation-bootstrap-port"):
            if not eq:
                if i + 1 >= len(words):
                    raise ValueError(f"{name}: needs a value")
                value = words[i + 1]
                i += 1
            taken[name] = value
        else:
            rest.append(word)
        i += 1
    mode = taken.get("--disaggregation-mode", "null")
    if mode not in MODES:
        raise ValueError(f"--disaggregation-mode: must be one of {', '.join(MODES)}, got "
                         f"{mode!r}")
    backend = taken.get("--disaggregation-transfer-backend", "mooncake")
    if backend not in BACKENDS:
        raise ValueError(f"--disaggregation-transfer-backend: pdmesh moves KV through its "
                         f"Mooncake pool ({' or '.join(BACKENDS)}), got {backend!r}")
    warnings = []
    if "--disaggregation-bootstrap-port" in taken:
        warnings.append("--disaggregation-bootstrap-port: without effect (instances find "
                        "each other through the registry and the kvstore)")
    if mode != "null" and "--disaggregation-transfer-backend" not in taken:
        warnings.append("--disaggregation-transfer-backend: not given; pdmesh's Mooncake "
                        "pool moves the KV")
    command = MODES[mode]
    if command == "serve" and not any(w == "--port" or w.startswith("--port=")
                                      for w in rest):
        rest += ["--port", SGLANG_PORT]
    return [command, *rest], warnings
