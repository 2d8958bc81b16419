"""The same requests to pdmesh and to vLLM serving the same weights, answers compared
(issue 41): status, the fields at every level of the JSON (and of each streamed chunk),
finish reasons, usage and, for greedy requests, the text.

    .venv/bin/python scripts/vllm_diff.py --pdmesh http://127.0.0.1:8000 \
        --vllm http://127.0.0.1:8011 --model tiny --report /tmp/diff.json \
        --record tests/services/gateway/golden/vllm_shapes.json

Both servers serve the model under one name (``--model``), with the hermes tool parser
(`--enable-auto-tool-choice --tool-call-parser hermes`). ``--record`` writes what vLLM
answered, reduced to what is compared (status, field paths, finish reasons, usage, text),
as the golden file tests/services/gateway/test_tools_e2e.py::test_answers_have_vllm_s_shapes
checks pdmesh against without vLLM (``--golden``). Fields whose values differ on purpose
are in ``EXPECTED``; the differences that remain on purpose, with their reasons, in
``KNOWN`` (docs/vllm-crosscheck.md). Exit status 1 when any other difference is found.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import httpx

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "ok"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}

# (path, the reason) of fields pdmesh answers differently on purpose
EXPECTED: dict[str, str] = {
    "owned_by": "pdmesh names itself where vLLM says vllm (value only)",
    "system_fingerprint": "present in both, null in both: compared as a field only",
}

# the differences that remain on purpose, (requests, difference) as regular expressions,
# with the reason (docs/vllm-crosscheck.md); any other difference fails the comparison
CACHED = ("OpenAI's usage always reports cached prompt tokens; vLLM 0.32 only with "
          "--enable-prompt-tokens-details")
KNOWN: list[tuple[str, str, str]] = [
    (r".*", r"only pdmesh has \['usage\.prompt_tokens_details(\.cached_tokens)?'"
            r"(, 'usage\.prompt_tokens_details\.cached_tokens')?\]$", CACHED),
    (r"model-card", r".*", "OpenAI's GET /v1/models/{model}: vLLM 0.32 has no such route "
                          "(404)"),
    (r"cmpl-best-of", r"usage\.(completion|total)_tokens", "vLLM 0.32 ignores best_of "
     "(gone with its V1 engine) and generates n; pdmesh generates best_of candidates as "
     "OpenAI does and counts them all"),
    (r"chat-json-schema|chat-tools-(required|named|no-parallel)(-stream)?",
     r"^(finish|usage\.)|^only pdmesh has \['choices\[\]\.message\.tool_calls'"
     r"(, 'choices\[\]\.message\.tool_calls\[\][.a-z_]+')*"
     r", 'usage\.prompt_tokens_details\.cached_tokens'\]$",
     "a forced JSON or tool call: pdmesh's grammar ends the answer once the JSON is "
     "complete (a valid call, finish tool_calls / stop); vLLM 0.32 on CPU lets the tiny "
     "model write whitespace or unconstrained arguments until max_tokens (no call)"),
    (r"responses", r"only pdmesh has \['error'\]$", "OpenAI's Response carries "
                                                      "error: null; vLLM 0.32 leaves it out"),
    (r"responses", r"only vLLM has \['usage\.input_tokens_details\.cache_write_tokens'\]$",
     "vLLM's own count of prompt tokens newly written to its prefix cache; not "
     "in OpenAI's Response, not sent by pdmesh"),
]


def known(name: str, line: str) -> str | None:
    """The reason ``line`` of request ``name`` differs on purpose (None: it should not)."""
    for names, lines, why in KNOWN:
        if re.fullmatch(names, name) and re.search(lines, line):
            return why
    return None


def requests(model: str) -> list[tuple[str, str, str, Any]]:
    """(name, method, path, body): ~60 requests over the API's surface."""
    def c(**kw: Any) -> dict[str, Any]:
        return {"model": model, "prompt": "def add(a, b):", "max_tokens": 8,
                "temperature": 0, **kw}

    def m(**kw: Any) -> dict[str, Any]:
        return {"model": model, "messages": ASK, "max_tokens": 8, "temperature": 0, **kw}

    return [
        ("models", "GET", "/v1/models", None),
        ("model-card", "GET", f"/v1/models/{model}", None),
        ("tokenize", "POST", "/tokenize", {"model": model, "prompt": "hello world"}),
        ("tokenize-strs", "POST", "/tokenize", {"model": model, "prompt": "hello",
                                                "return_token_strs": True}),
        ("tokenize-chat", "POST", "/tokenize", {"model": model, "messages": ASK}),
        ("detokenize", "POST", "/detokenize", {"model": model, "tokens": [100, 200, 300]}),
        ("cmpl", "POST", "/v1/completions", c()),
        ("cmpl-ids", "POST", "/v1/completions", c(prompt=[5, 6, 7, 8])),
        ("cmpl-batch", "POST", "/v1/completions", c(prompt=["a", "b c"])),
        ("cmpl-stream", "POST", "/v1/completions", c(stream=True)),
        ("cmpl-stream-usage", "POST", "/v1/completions",
         c(stream=True, stream_options={"include_usage": True})),
        ("cmpl-logprobs", "POST", "/v1/completions", c(logprobs=2)),
        ("cmpl-logprobs-stream", "POST", "/v1/completions", c(logprobs=2, stream=True)),
        ("cmpl-echo", "POST", "/v1/completions", c(echo=True, max_tokens=4)),
        ("cmpl-echo-logprobs", "POST", "/v1/completions", c(echo=True, logprobs=1,
                                                             max_tokens=4)),
        ("cmpl-n", "POST", "/v1/completions", c(n=3, temperature=1.0, seed=3)),
        ("cmpl-best-of", "POST", "/v1/completions", c(n=1, best_of=3, temperature=1.0,
                                                       seed=3)),
        ("cmpl-stop", "POST", "/v1/completions", c(stop=["\n"], max_tokens=16)),
        ("cmpl-stop-ids", "POST", "/v1/completions", c(stop_token_ids=[13], max_tokens=16)),
        ("cmpl-min-tokens", "POST", "/v1/completions", c(min_tokens=4, max_tokens=6)),
        ("cmpl-logit-bias", "POST", "/v1/completions", c(logit_bias={"100": 100})),
        ("cmpl-seed", "POST", "/v1/completions", c(temperature=0.9, seed=11)),
        ("cmpl-ignore-eos", "POST", "/v1/completions", c(ignore_eos=True)),
        ("cmpl-prompt-logprobs", "POST", "/v1/completions", c(prompt_logprobs=1,
                                                               max_tokens=2)),
        ("cmpl-no-max-tokens", "POST", "/v1/completions", {"model": model, "prompt": "x",
                                                            "temperature": 0}),
        ("cmpl-guided-choice", "POST", "/v1/completions",
         c(structured_outputs={"choice": ["yes", "no"]})),
        ("cmpl-guided-regex", "POST", "/v1/completions",
         c(structured_outputs={"regex": "[0-9]{3}"}, max_tokens=8)),
        ("chat", "POST", "/v1/chat/completions", m()),
        ("chat-stream", "POST", "/v1/chat/completions", m(stream=True)),
        ("chat-stream-usage", "POST", "/v1/chat/completions",
         m(stream=True, stream_options={"include_usage": True})),
        ("chat-logprobs", "POST", "/v1/chat/completions", m(logprobs=True, top_logprobs=2)),
        ("chat-logprobs-stream", "POST", "/v1/chat/completions",
         m(logprobs=True, top_logprobs=2, stream=True)),
        ("chat-n", "POST", "/v1/chat/completions", m(n=2, temperature=1.0, seed=5)),
        ("chat-max-completion", "POST", "/v1/chat/completions",
         {"model": model, "messages": ASK, "max_completion_tokens": 6, "temperature": 0}),
        ("chat-stop", "POST", "/v1/chat/completions", m(stop=["."], max_tokens=16)),
        ("chat-system", "POST", "/v1/chat/completions",
         m(messages=[{"role": "system", "content": "be short"}, *ASK])),
        ("chat-history", "POST", "/v1/chat/completions", m(messages=[
            *ASK, {"role": "assistant", "content": "sunny"}, {"role": "user",
                                                               "content": "and Rome?"}])),
        ("chat-json-object", "POST", "/v1/chat/completions",
         m(response_format={"type": "json_object"}, max_tokens=24)),
        ("chat-json-schema", "POST", "/v1/chat/completions",
         m(response_format={"type": "json_schema", "json_schema": {"name": "r",
                                                                    "schema": SCHEMA}},
           max_tokens=24)),
        ("chat-structured-choice", "POST", "/v1/chat/completions",
         m(structured_outputs={"choice": ["yes", "no"]})),
        ("chat-tools-none", "POST", "/v1/chat/completions",
         m(tools=TOOLS, tool_choice="none")),
        ("chat-tools-auto", "POST", "/v1/chat/completions", m(tools=TOOLS, tool_choice="auto")),
        ("chat-tools-required", "POST", "/v1/chat/completions",
         m(tools=TOOLS, tool_choice="required", max_tokens=48)),
        ("chat-tools-named", "POST", "/v1/chat/completions",
         m(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
           max_tokens=32)),
        ("chat-tools-named-stream", "POST", "/v1/chat/completions",
         m(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
           max_tokens=32, stream=True)),
        ("chat-tools-required-stream", "POST", "/v1/chat/completions",
         m(tools=TOOLS, tool_choice="required", max_tokens=48, stream=True)),
        ("chat-tools-no-parallel", "POST", "/v1/chat/completions",
         m(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=48)),
        ("chat-tool-result", "POST", "/v1/chat/completions", m(tools=TOOLS, messages=[
            *ASK, {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18"}])),
        ("chat-min-tokens", "POST", "/v1/chat/completions", m(min_tokens=4, max_tokens=6)),
        ("chat-logit-bias", "POST", "/v1/chat/completions", m(logit_bias={"100": 100})),
        ("chat-template-kwargs", "POST", "/v1/chat/completions",
         m(chat_template_kwargs={"enable_thinking": False})),
        ("responses", "POST", "/v1/responses", {"model": model, "input": "hello",
                                                "max_output_tokens": 16, "temperature": 0}),
        # errors: status and OpenAI's error shape
        ("err-model", "POST", "/v1/completions", c(model="nope")),
        ("err-temperature", "POST", "/v1/completions", c(temperature=-1)),
        ("err-max-tokens", "POST", "/v1/completions", c(max_tokens=10 ** 7)),
        ("err-no-prompt", "POST", "/v1/completions", {"model": model}),
        ("err-chat-no-messages", "POST", "/v1/chat/completions", {"model": model}),
        ("err-top-logprobs", "POST", "/v1/chat/completions", m(top_logprobs=3)),
        ("err-n", "POST", "/v1/completions", c(n=0)),
        ("err-bad-json", "POST", "/v1/completions", b"{"),
    ]


def paths(value: Any, at: str = "") -> set[str]:
    """Every field path in ``value``, list items folded into ``[]``."""
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            key = "<token>" if at.endswith("top_logprobs[]") else k  # (keys that are text)
            if at.endswith("prompt_logprobs[]"):
                key = "<id>"
            p = f"{at}.{key}" if at else key
            out.add(p)
            out |= paths(v, p)
    elif isinstance(value, list):
        for v in value:
            out |= paths(v, f"{at}[]")
    return out


def ask(client: httpx.Client, base: str, method: str, path: str, body: Any) -> dict:
    """One request's answer, reduced: status, field paths, finish reasons, usage, text."""
    kw: dict[str, Any] = {}
    if isinstance(body, bytes):
        kw = {"content": body, "headers": {"Content-Type": "application/json"}}
    elif body is not None:
        kw = {"json": body}
    stream = isinstance(body, dict) and body.get("stream")
    if not stream:
        r = client.request(method, base + path, **kw)
        try:
            data = r.json()
        except ValueError:
            data = None
        return {"status": r.status_code, "paths": sorted(paths(data)), **_facts(data)}
    found: set[str] = set()
    texts: dict[int, str] = {}
    reasons: set[str] = set()
    usage = None
    with client.stream(method, base + path, **kw) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            found |= paths(chunk)
            usage = chunk.get("usage") or usage
            for ch in chunk.get("choices") or []:
                d = ch.get("delta") or {}
                texts[ch.get("index", 0)] = texts.get(ch.get("index", 0), "") + (
                    ch.get("text") or d.get("content") or "")
                if ch.get("finish_reason"):
                    reasons.add(ch["finish_reason"])
    return {"status": r.status_code, "paths": sorted(found), "finish": sorted(reasons),
            "usage": usage, "text": [texts[i] for i in sorted(texts)]}


def _facts(data: Any) -> dict:
    if not isinstance(data, dict):
        return {}
    choices = data.get("choices") or []
    return {"finish": sorted({c.get("finish_reason") or "" for c in choices}),
            "usage": data.get("usage"),
            "text": [c.get("text") if "text" in c else (c.get("message") or {}).get("content")
                     for c in choices]}


def compare(name: str, body: Any, ours: dict, theirs: dict) -> list[str]:
    out = []
    if ours["status"] != theirs["status"]:
        out.append(f"status {ours['status']} vs vLLM's {theirs['status']}")
    if ours["status"] != 200 or theirs["status"] != 200:  # errors: the shape only
        only = set(theirs["paths"]) ^ set(ours["paths"])
        if only - {"error.param"}:
            out.append(f"error fields differ: {sorted(only)}")
        return out
    for label, a, b in (("only pdmesh has", ours["paths"], theirs["paths"]),
                        ("only vLLM has", theirs["paths"], ours["paths"])):
        extra = sorted(p for p in set(a) - set(b) if p.rsplit(".", 1)[-1] not in EXPECTED)
        if extra:
            out.append(f"{label} {extra}")
    if ours.get("finish") != theirs.get("finish"):
        out.append(f"finish {ours.get('finish')} vs {theirs.get('finish')}")
    u, v = ours.get("usage") or {}, theirs.get("usage") or {}
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        if k in v and u.get(k) != v.get(k):
            out.append(f"usage.{k} {u.get(k)} vs {v.get(k)}")
    greedy = isinstance(body, dict) and body.get("temperature") == 0 and not (
        body.get("response_format") or body.get("structured_outputs") or body.get("tools"))
    if greedy and ours.get("text") != theirs.get("text"):
        out.append(f"text {ours.get('text')!r} vs {theirs.get('text')!r}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pdmesh", required=True)
    p.add_argument("--vllm", default=None, help="vLLM's URL (else: --golden's answers)")
    p.add_argument("--golden", default=None, help="vLLM's answers recorded by --record")
    p.add_argument("--model", default="tiny")
    p.add_argument("--report", default=None)
    p.add_argument("--record", default=None)
    a = p.parse_args()
    reqs = requests(a.model)
    with httpx.Client(timeout=120) as client:
        ours = {n: ask(client, a.pdmesh, meth, path, body) for n, meth, path, body in reqs}
        if a.vllm:
            theirs = {n: ask(client, a.vllm, meth, path, body) for n, meth, path, body in reqs}
        else:
            theirs = json.loads(Path(a.golden).read_text())
    diffs = {n: compare(n, body, ours[n], theirs[n]) for n, _, _, body in reqs if n in theirs}
    unexpected = {n: [d for d in ds if known(n, d) is None] for n, ds in diffs.items()}
    same = [n for n, d in diffs.items() if not d]
    reasons = sorted({why for n, ds in diffs.items() for d in ds if (why := known(n, d))})
    bad = [n for n, d in unexpected.items() if d]
    print(f"{len(diffs)} requests: {len(same)} answered alike (status, fields at every "
          f"level, finish reasons, usage, greedy text), {len(diffs) - len(same) - len(bad)} "
          f"differ only as documented, {len(bad)} differ otherwise")
    for why in reasons:
        hit = [n for n, ds in diffs.items() if any(known(n, d) == why for d in ds)]
        print(f"  documented ({len(hit)}): {why}")
    for n in bad:
        for line in unexpected[n]:
            print(f"  UNEXPECTED {n}: {line}")
    if a.report:
        Path(a.report).write_text(json.dumps({"ours": ours, "vllm": theirs, "diffs": diffs},
                                             indent=1))
    if a.record and a.vllm:
        Path(a.record).write_text(json.dumps(theirs, indent=1, sort_keys=True) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
