"""vLLM-Ascend's proxy line read as the gateway's (the end-to-end run is in
tests/services/gateway/test_proxy_e2e.py)."""

from __future__ import annotations

import pytest

from pdmesh.cli import parse_args
from pdmesh.services.gateway.proxy_line import translate_proxy


def test_the_recipe_s_proxy_line_becomes_a_gateway_dialling_its_nodes():
    asked = []

    def find_model(prefill, decode, wait_s):
        asked.append((prefill, decode, wait_s))
        return "/models/dsv4", "dsv4"

    line, warnings = translate_proxy(
        ["--host", "0.0.0.0", "--port", "8000", "--prefiller-hosts", "10.0.0.1", "10.0.0.2",
         "--prefiller-ports", "8001", "8001", "--decoder-hosts", "10.0.0.3",
         "--decoder-ports", "8002", "--workers", "4", "--log-level", "debug"],
        find_model=find_model)
    assert asked == [(["10.0.0.1:8001", "10.0.0.2:8001"], ["10.0.0.3:8002"], 30.0)]
    assert line == ["gateway", "--model", "/models/dsv4", "--served-model-name", "dsv4",
                    "--host", "0.0.0.0", "--port", "8000", "--log-level", "DEBUG",
                    "--prefill-addresses", "10.0.0.1:8001", "10.0.0.2:8001",
                    "--decode-addresses", "10.0.0.3:8002", "--instance-grace", "30"]
    assert [w.split(":")[0] for w in warnings] == ["--workers"]
    _, command, config = parse_args(line)  # the gateway takes what it was given
    assert list(config.prefill_addresses) == ["10.0.0.1:8001", "10.0.0.2:8001"]


def test_a_model_on_the_line_is_used_and_defaults_are_vllm_ascend_s():
    line, _ = translate_proxy(["--model", "/m", "--max-waiting-retries", "2",
                               "--waiting-retry-interval", "1.5"],
                              find_model=lambda *a: pytest.fail("asked the instances"))
    assert line == ["gateway", "--host", "localhost", "--port", "8000", "--log-level", "INFO",
                    "--prefill-addresses", "localhost:8001", "--decode-addresses",
                    "localhost:8002", "--instance-grace", "3", "--model", "/m"]


@pytest.mark.parametrize(("words", "named"), [
    (["--prefiller-hosts", "a", "b", "--prefiller-ports", "1"], "--prefiller-hosts"),
    (["--decoder-ports", "http"], "--decoder-ports"),
    (["--max-waiting-retries", "x"], "--max-waiting-retries"),
    (["--port"], "--port"),
])
def test_a_bad_proxy_line_is_refused_naming_the_flag(words, named):
    with pytest.raises(ValueError, match=named):
        translate_proxy(["--model", "/m", *words])
