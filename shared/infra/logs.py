"""Log lines: plain text, or JSON (``--log-format json``) for a log pipeline, with the
request id and trace id of the record when it has them (``extra={"request_id": ...}``).

Requests are logged by the gateway with ``--log-requests`` at the detail
``--log-requests-level`` asks for (SGLang's levels): 0 metadata, 1 + sampling
parameters, 2 + the start of the input and output, 3 + all of them.
"""

from __future__ import annotations

import json
import logging
import time

REQUEST_LOG = "pdmesh.requests"
PARTIAL_CHARS = 200  # level 2: this much of the input and the output


class JsonFormatter(logging.Formatter):
    FIELDS = ("request_id", "trace_id", "request")

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
               + f".{int(record.msecs):03d}Z", "level": record.levelname,
               "logger": record.name, "message": record.getMessage()}
        for key in self.FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(level: str, fmt: str = "text") -> None:
    if fmt not in ("text", "json"):
        raise ValueError(f"--log-format: must be text or json, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def request_record(level: int, *, request_id: str, model: str, prompt_tokens: int,
                   completion_tokens: int, finish_reason: str | None, seconds: float,
                   ttft_s: float | None, params: object, prompt_text: str,
                   output_text: str) -> dict[str, object]:
    """What --log-requests-level ``level`` (0-3) puts in a finished request's line."""
    if not 0 <= level <= 3:
        raise ValueError(f"--log-requests-level: must be 0, 1, 2 or 3, got {level}")
    rec: dict[str, object] = {
        "request_id": request_id, "model": model, "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens, "finish_reason": finish_reason,
        "e2e_s": round(seconds, 4), "ttft_s": None if ttft_s is None else round(ttft_s, 4)}
    if level >= 1:
        rec["sampling_params"] = {k: v for k, v in vars(params).items()
                                  if not k.startswith("_")}
    if level == 2:
        rec["input"] = prompt_text[:PARTIAL_CHARS]
        rec["output"] = output_text[:PARTIAL_CHARS]
    elif level == 3:
        rec["input"] = prompt_text
        rec["output"] = output_text
    return rec
