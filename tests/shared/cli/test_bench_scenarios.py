"""`pdmesh bench serve` scenarios: deterministic, within the context, shaped as named;
and one run end to end against a real `pdmesh serve`."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from pdmesh.shared.cli.bench.scenarios import (
    SCENARIOS,
    ScenarioArgs,
    Session,
    Turn,
    build,
    parse_goodput,
    reusable_prefix_tokens,
)
from tests.shared.cli.test_up import launch, shut


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_scenario_is_deterministic_and_fits_the_context(name):
    a = ScenarioArgs(name, num_prompts=40, request_rate=4.0, max_context=1024, seed=3)
    sessions = build(a)
    assert sessions == build(a)  # the same seed, the same requests
    assert sessions != build(ScenarioArgs(name, num_prompts=40, request_rate=4.0,
                                          max_context=1024, seed=4))
    assert len(sessions) == 40
    starts = [s.start_s for s in sessions]
    assert starts == sorted(starts) and starts[0] == 0.0
    for s in sessions:
        assert s.turns
        for t in s.turns:
            assert 1 <= t.output_len and len(t.prompt) + t.output_len <= 1024
            assert all(10 <= x < 4000 for x in t.prompt)


def test_the_shapes_are_what_they_say():
    ctx = 4096
    long = [s.turns[0] for s in build(ScenarioArgs("long-mixed", 200, 2.0, max_context=ctx))]
    lens = [len(t.prompt) for t in long]
    assert min(lens) >= ctx // 8 and max(lens) <= 3 * ctx // 4
    assert max(lens) > 4 * min(lens)  # a wide spread, not one shape
    out = [s.turns[0].output_len for s in build(ScenarioArgs("long-output", 50, 2.0))]
    assert min(out) >= 512
    # shared prefixes: every request starts with one of num_prefixes long prompts
    shared = [s.turns[0].prompt for s in build(ScenarioArgs("shared-prefix", 60, 2.0,
                                                            max_context=ctx, num_prefixes=3))]
    heads = {tuple(p[:ctx // 4]) for p in shared}
    assert len(heads) == 3 and all(len(p) > ctx // 4 for p in shared)
    # multi-turn: each turn's prompt extends the previous prompt (and its answer)
    convs = build(ScenarioArgs("multi-turn", 30, 1.0, max_context=ctx))
    assert any(len(c.turns) >= 3 for c in convs)
    for c in convs:
        for prev, nxt in zip(c.turns, c.turns[1:], strict=False):
            assert nxt.prompt[:len(prev.prompt)] == prev.prompt
            assert len(nxt.prompt) >= len(prev.prompt) + prev.output_len + 32
    # agent: a long context of its own, then up to `turns` turns over it
    agents = build(ScenarioArgs("agent", 40, math.inf, max_context=ctx, turns=8))
    assert max(len(s.turns) for s in agents) == 8 and {s.start_s for s in agents} == {0.0}
    firsts = [len(s.turns[0].prompt) for s in agents]
    assert min(firsts) >= ctx // 4 and max(firsts) <= ctx // 2 + 256
    assert len({tuple(s.turns[0].prompt[:ctx // 4]) for s in agents}) == 40  # none shared
    for s in agents:
        for prev, nxt in zip(s.turns, s.turns[1:], strict=False):
            assert nxt.prompt[:len(prev.prompt)] == prev.prompt
            assert len(nxt.prompt) >= len(prev.prompt) + prev.output_len + 32
    # bursts: burst_size sessions at once, every burst_interval_s
    bursts = build(ScenarioArgs("burst", 10, burst_size=4, burst_interval_s=2.5))
    assert [s.start_s for s in bursts] == [0.0] * 4 + [2.5] * 4 + [5.0] * 2
    # any scenario may arrive in bursts, its shapes unchanged
    long_bursts = build(ScenarioArgs("long-mixed", 6, 2.0, max_context=ctx, arrival="burst",
                                     burst_size=3, burst_interval_s=4.0))
    assert [s.start_s for s in long_bursts] == [0.0] * 3 + [4.0] * 3
    # the same requests however they arrive: paced, all at once, in bursts
    paced = build(ScenarioArgs("long-mixed", 6, 2.0, max_context=ctx))
    at_once = build(ScenarioArgs("long-mixed", 6, math.inf, max_context=ctx))
    assert [s.turns for s in long_bursts] == [s.turns for s in paced] == [
        s.turns for s in at_once]
    assert [s.start_s for s in at_once] == [0.0] * 6 and paced[-1].start_s > 0
    with pytest.raises(ValueError, match="arrival"):
        build(ScenarioArgs("long-mixed", 6, arrival="sometimes"))
    # all at once without a rate
    assert {s.start_s for s in build(ScenarioArgs("short-chat", 8, math.inf))} == {0.0}


def test_the_reusable_prefix_is_what_a_perfect_cache_would_serve():
    a, b = list(range(10, 30)), list(range(40, 50))
    sessions = [Session(1.0, [Turn(a + [1, 2], 4)]),  # sent after the next: a reusable
                Session(0.0, [Turn(a, 4), Turn(a + b, 4)]),  # nothing, then a
                Session(2.0, [Turn(b, 4)])]  # b never started a prompt before
    assert reusable_prefix_tokens(sessions) == (0 + 20 + 20 + 0, 20 + 30 + 22 + 10)
    # a prompt sent again: all but its last token (every prompt computes one)
    assert reusable_prefix_tokens([Session(0.0, [Turn(a, 4), Turn(a, 4)])]) == (19, 40)


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="scenario"):
        build(ScenarioArgs("nope"))
    with pytest.raises(ValueError, match="num_prompts"):
        build(ScenarioArgs("random", num_prompts=0))
    with pytest.raises(ValueError, match="max_context"):
        build(ScenarioArgs("random", max_context=10))
    with pytest.raises(ValueError, match="turns"):
        build(ScenarioArgs("agent", turns=0))
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    for bad in (["ttft"], ["itl:5"], ["tpot:x"], ["tpot:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_a_multi_turn_run_against_pdmesh_serve(qwen3_path, tmp_path, registry_prefix):
    prefix = f"{registry_prefix}-bench-mt"
    proc, url, out = launch("serve", str(qwen3_path), "--port", "0", "--registry-prefix",
                            prefix, "--log-dir", str(tmp_path), "--served-model-name", "tiny",
                            "--engine-args", "--device cpu --dtype float32 --block-size 16")
    try:
        assert url, "".join(out)
        result = tmp_path / "mt.json"
        r = subprocess.run([sys.executable, "-m", "pdmesh", "bench", "serve", "--base-url",
                            url, "--model", "tiny", "--scenario", "multi-turn",
                            "--num-prompts", "3", "--max-context", "640", "--request-rate",
                            "20", "--goodput", "ttft:60000", "tpot:0.01", "--json", str(result),
                            "--save-detailed", "--no-progress"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        res = json.loads(result.read_text())
        turns = sum(len(s.turns) for s in build(ScenarioArgs("multi-turn", 3, 20.0,
                                                             max_context=640)))
        assert res["completed"] == turns and res["failed"] == 0
        assert res["ttft_ms_median"] > 0 and res["e2e_ms_p99"] >= res["e2e_ms_median"]
        # a TPOT of at most 10 us is out of reach over HTTP: no request is good
        assert res["goodput_fraction"] == 0.0 and "goodput" in r.stdout
        # later turns find the earlier ones' prompts in the prefix cache, never more than
        # a perfect cache would
        assert 0 < res["prefix_hit_fraction"] <= res["prefix_reusable_fraction"] < 1
        assert "prompt tokens cached" in r.stdout
        # --save-detailed: every request, its ITLs one fewer than its output tokens
        detail = res["requests"]
        assert len(detail) == turns and res["started_unix"] > 0
        assert all(d["ok"] and d["ttft_ms"] > 0 and len(d["itl_ms"]) <= d["output_tokens"] - 1
                   for d in detail)
        assert sum(len(d["itl_ms"]) for d in detail) > 0
        starts = [d["start_s"] for d in detail]
        assert min(starts) >= 0 and max(starts) < res["duration_s"]
    finally:
        shut(proc, prefix)
