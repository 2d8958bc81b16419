"""`pdmesh sglang`: SGLang's launch_server line. Every flag the seeds mark supported on
Ascend is accepted; those pdmesh implements take effect under their SGLang names, the
rest are listed as without effect; the disaggregation mode picks the instance."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdmesh.cli import _translated_line, parse_args
from pdmesh.shared.cli.sglang import translate
from pdmesh.shared.config.serve import serve_config
from tests.mesh import stop_all

FLAGS = Path(__file__).parents[1] / "config" / "data" / "sglang_ascend_flags.tsv"
DISAGGREGATION = {"--disaggregation-mode", "--disaggregation-transfer-backend",
                  "--disaggregation-bootstrap-port"}


def seed_flags() -> list[tuple[str, str]]:
    rows = [ln.split("\t") for ln in FLAGS.read_text().splitlines() if not ln.startswith("#")]
    return [(name, value) for name, value in rows]


def test_the_seed_lists_119_supported_flags():
    assert len(seed_flags()) == 119


@pytest.mark.parametrize(("flag", "value"), seed_flags(), ids=[f for f, _ in seed_flags()])
def test_every_ascend_supported_flag_is_accepted(flag, value):
    words = ["sglang", "--model-path", "/m", flag, *([value] if value else [])]
    line = _translated_line(words)
    assert line[0] == "serve"
    _, command, flags = parse_args(line, resolve=False)  # read by the one table
    assert command.name == "serve"
    if flag not in DISAGGREGATION:
        assert flag in line


def test_implemented_flags_take_effect_and_the_rest_are_listed():
    line = _translated_line(["sglang", "--model-path", "/tmp/m", "--device", "cpu",
                         "--chunked-prefill-size", "512", "--max-running-requests", "7",
                         "--page-size", "32", "--context-length", "256",
                         "--mem-fraction-static", "0.5", "--disable-radix-cache",
                         "--tp-size", "1", "--enable-dp-attention", "--speculative-algorithm",
                         "NEXTN", "--cuda-graph-bs", "1", "2", "4"])
    _, _, cfg = parse_args(["config", "check", "--role", "mixed", *line[1:]])
    engine = cfg.engine
    assert (engine.max_num_batched_tokens, engine.max_num_seqs, engine.block_size,
            engine.max_model_len, engine.gpu_memory_utilization,
            engine.enable_prefix_caching) == (512, 7, 32, 256, 0.5, False)
    # (NEXTN: DeepSeek's MTP, read into --speculative-config, which runs it)
    assert "--enable-dp-attention" not in cfg.accepted_without_effect  # (DP 1: one rank)
    # the decode graphs' sizes (captured on cuda / npu)
    assert "--cuda-graph-bs" not in cfg.accepted_without_effect
    assert engine.graph_config().sizes == (1, 2, 4)
    assert "--speculative-config" not in cfg.accepted_without_effect
    assert engine.speculative_config.is_mtp
    # --max-num-batched-tokens wins; -1 is SGLang's "no chunking" (no CPU default cap)
    _, _, both = parse_args(["config", "check", "--role", "mixed", "--model", "/tmp/m",
                             "--device", "cpu", "--max-num-batched-tokens", "100",
                             "--max-prefill-tokens", "50"])
    assert both.engine.max_num_batched_tokens == 100
    _, _, off = parse_args(["config", "check", "--role", "mixed", "--model", "/tmp/m",
                            "--device", "cpu", "--chunked-prefill-size", "-1"])
    assert off.engine.max_num_batched_tokens is None


def test_the_disaggregation_mode_picks_the_instance():
    assert translate(["--model-path", "m"])[0] == ["serve", "--model-path", "m", "--port",
                                                   "30000"]
    assert translate(["--model-path", "m", "--port", "8000"])[0][-2:] == ["--port", "8000"]
    line, warnings = translate(["--model-path", "m", "--disaggregation-mode=prefill",
                                "--disaggregation-transfer-backend", "ascend",
                                "--disaggregation-bootstrap-port", "8998"])
    assert line == ["prefill", "--model-path", "m"]
    assert any("bootstrap-port" in w for w in warnings)
    assert translate(["--disaggregation-mode", "decode"])[0][0] == "decode"
    with pytest.raises(ValueError, match="--disaggregation-mode: must be one of"):
        translate(["--disaggregation-mode", "both"])
    with pytest.raises(ValueError, match="--disaggregation-transfer-backend: .* 'nixl'"):
        translate(["--disaggregation-transfer-backend", "nixl"])
    with pytest.raises(ValueError, match="--disaggregation-mode: needs a value"):
        translate(["--disaggregation-mode"])


def check(*words: str):
    return serve_config("config check", ["--role", "mixed", "--model", "/tmp/m", "--device",
                                         "cpu", *words])


def test_speculative_flags_become_vllms_speculative_config():
    """Read by every command (here a service line, as `pdmesh mixed` reads it)."""
    cfg = check("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4",
                "--speculative-accept-threshold-acc", "0.5")
    spec = cfg.engine.speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    assert "--speculative-accept-threshold-acc" in cfg.accepted_without_effect
    assert "--speculative-algorithm" not in cfg.accepted_without_effect
    spec = check("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2"
                 ).engine.speculative_config
    assert (spec.is_mtp, spec.num_speculative_tokens) == (True, 2)
    # without an algorithm the others do nothing, and say so
    cfg = check("--speculative-num-steps", "2")
    assert cfg.engine.speculative_config is None
    assert any(w.startswith("--speculative-num-steps: without effect") for w in
               cfg.flag_warnings)
    # `pdmesh sglang` hands them on as they are
    line, _ = translate(["--model-path", "m", "--speculative-algorithm", "NEXTN"])
    assert "--speculative-algorithm" in line and "--speculative-config" not in line
    for words, flag in ((["--speculative-algorithm", "MEDUSA"], "--speculative-algorithm"),
                        (["--speculative-algorithm", "NGRAM",
                          "--speculative-num-draft-tokens", "1"],
                         "--speculative-num-draft-tokens")):
        with pytest.raises(ValueError, match=f"^{flag}: "):
            check(*words)


def run(*words: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdmesh", *words], capture_output=True,
                          text=True, timeout=120)


def test_a_misspelt_flag_gets_a_did_you_mean():
    r = run("sglang", "--model-path", "/m", "--chunked-prefil-size", "512")
    assert r.returncode == 2 and "did you mean --chunked-prefill-size" in r.stderr
    r = run("sglang", "--model-path", "/m", "--disaggregation-transfer-backend", "nixl")
    assert r.returncode == 2 and "--disaggregation-transfer-backend" in r.stderr


def test_an_translated_line_serves(qwen3_path, tmp_path, registry_prefix):
    """A seed-like SGLang line starts a real mesh (mixed instance + gateway) and serves;
    the flags beyond it are listed at start-up."""
    from tests.shared.cli.test_up import kill_all, launch

    proc, url, out = launch("sglang", "--model-path", str(qwen3_path), "--port", "0",
                            "--registry-prefix", registry_prefix + "-sgl", "--log-dir",
                            str(tmp_path), "--device", "cpu", "--tp-size", "1",
                            "--mem-fraction-static", "0.8", "--chunked-prefill-size", "256",
                            "--max-running-requests", "16", "--enable-dp-attention",
                            "--disable-cuda-graph", "--trust-remote-code")
    try:
        assert url, "".join(out)
        text = "".join(out)
        assert "--enable-dp-attention" in text and "--trust-remote-code" in text
        assert "--disable-cuda-graph" not in text  # (it takes effect)
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": str(qwen3_path), "prompt": [5, 6, 7, 8], "max_tokens": 4,
            "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        kill_all(proc, registry_prefix + "-sgl")


def test_the_router_line_becomes_the_gateway():
    from pdmesh.shared.cli.sglang import translate_router

    line, warnings = translate_router([
        "--pd-disaggregation", "--prefill", "http://p0:30000", "8998", "--prefill",
        "http://p1:30000", "--decode", "http://d0:30001", "--host", "0.0.0.0",
        "--port", "8000", "--policy", "cache_aware", "--model-path", "/models/m",
        "--max-payload-size", "1048576", "--log-level", "info", "--prometheus-port", "29000",
        "--request-id-headers", "x-request-id", "x-trace-id", "--redis-url", "redis://r:6379/0"])
    assert line == ["gateway", "/models/m", "--host", "0.0.0.0", "--port", "8000",
                    "--max-request-body-bytes", "1048576", "--log-level", "INFO",
                    "--redis-url", "redis://r:6379/0"]
    text = "\n".join(warnings)
    for flag in ("--policy", "--prometheus-port", "--request-id-headers"):
        assert f"{flag}: without effect" in text
    assert ("--prefill http://p0:30000 8998, --prefill http://p1:30000, "
            "--decode http://d0:30001: not dialled") in text
    line, _ = translate_router(["--tokenizer-path", "/t", "--pd-disaggregation"])
    assert line == ["gateway", "/t", "--port", "30000"]  # the router's port


def test_a_router_line_without_the_model_or_a_value_is_refused():
    from pdmesh.shared.cli.sglang import translate_router

    with pytest.raises(ValueError, match="--model-path"):
        translate_router(["--pd-disaggregation", "--decode", "http://d:1"])
    with pytest.raises(ValueError, match="--decode: needs a value"):
        translate_router(["--model-path", "/m", "--decode"])
    r = run("sglang-router", "--model-path", "/m", "--polcy", "random")
    assert r.returncode == 2 and "--polcy" in r.stderr


def test_sglang_pd_shape_serves(qwen3_path, tmp_path, registry_prefix):
    """SGLang's PD launch shape - a prefill and a decode `launch_server` line and the
    router's line, as SGLang writes them (no kvstore address: each instance finds the
    kvstore in the registry, waiting for one started after it) - runs as the mesh and
    answers like the offline engine."""
    from pdmesh.shared.engine import LLM, SamplingParams
    from pdmesh.shared.infra.launcher import Service

    reg = ["--registry-prefix", registry_prefix + "-sglpd"]
    started: list[Service] = []
    try:
        for mode in ("prefill", "decode"):
            started.append(Service(mode, [
                "sglang", "--model-path", str(qwen3_path), "--disaggregation-mode", mode,
                "--disaggregation-transfer-backend", "mooncake", "--device", "cpu",
                "--port", "0", "--page-size", "16", *reg], tmp_path, wait=False))
        engines = list(started)
        deadline = time.monotonic() + 120
        while not all("waiting up to" in e.log_path.read_text() for e in engines):
            assert time.monotonic() < deadline, "an engine did not wait for the kvstore"
            assert all(e.proc.poll() is None for e in engines), "an engine exited"
            time.sleep(0.2)
        started.append(Service("kvstore", ["kvstore", *reg], tmp_path))
        for engine in engines:
            engine.wait_ready()
        router = Service("gateway", [
            "sglang-router", "--pd-disaggregation", "--prefill", "http://127.0.0.1:30000",
            "--decode", "http://127.0.0.1:30001", "--host", "127.0.0.1", "--port", "0",
            "--model-path", str(qwen3_path), "--policy", "round_robin", *reg], tmp_path)
        started.append(router)
        r = httpx.post(router.info["http"] + "/v1/completions", timeout=60, json={
            "model": str(qwen3_path), "prompt": [5, 6, 7, 8], "max_tokens": 6,  # SGLang's
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        want = LLM(str(qwen3_path), device="cpu", block_size=16).generate(
            [[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
        log = router.log_path.read_text()
        assert "--policy: without effect" in log and "not dialled" in log
    finally:
        stop_all(started)


def test_sglang_parser_names_become_the_gateway_parsers():
    line, _ = translate(["--model-path", "/m", "--reasoning-parser", "deepseek-r1",
                         "--tool-call-parser=qwen"])
    assert line[line.index("--reasoning-parser") + 1] == "deepseek_r1"
    assert "--tool-call-parser=hermes" in line
    _, _, flags = parse_args(_translated_line(["sglang", "--model-path", "/m",
                                           "--tool-call-parser", "llama3"]), resolve=False)
    assert flags.tool_call_parser == "llama3_json"
