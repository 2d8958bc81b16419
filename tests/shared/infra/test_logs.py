"""Log formatting and what each --log-requests-level records."""

from __future__ import annotations

import json
import logging

import pytest

from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.infra.logs import JsonFormatter, request_record, setup_logging


def record(level: int) -> dict:
    return request_record(level, request_id="cmpl-1", model="m", prompt_tokens=3,
                          completion_tokens=2, finish_reason="length", seconds=0.5,
                          ttft_s=0.1, params=SamplingParams(max_tokens=2),
                          prompt_text="x" * 500, output_text="y" * 300)


def test_request_levels_add_detail():
    assert set(record(0)) == {"request_id", "model", "prompt_tokens", "completion_tokens",
                              "finish_reason", "e2e_s", "ttft_s"}
    assert record(1)["sampling_params"]["max_tokens"] == 2 and "input" not in record(1)
    assert len(record(2)["input"]) == 200 and len(record(2)["output"]) == 200
    assert len(record(3)["input"]) == 500 and len(record(3)["output"]) == 300
    with pytest.raises(ValueError, match="--log-requests-level"):
        record(4)


def test_json_lines_carry_request_and_trace_ids():
    rec = logging.LogRecord("pdmesh.requests", logging.INFO, __file__, 1, "done %s",
                            ("cmpl-1",), None)
    rec.request_id, rec.trace_id = "cmpl-1", "ab" * 16
    out = json.loads(JsonFormatter().format(rec))
    assert out["message"] == "done cmpl-1" and out["request_id"] == "cmpl-1"
    assert out["trace_id"] == "ab" * 16 and out["level"] == "INFO"
    assert out["time"].endswith("Z")


def test_log_format_is_checked():
    with pytest.raises(ValueError, match="--log-format"):
        setup_logging("INFO", "xml")
