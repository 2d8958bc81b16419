"""Priority scheduling from either flag family, ShortRequestFirst from --additional-config,
and --max-queued-requests: parsed as an engine instance parses them, checked together,
and turned into EngineConfig fields (shared.config.engine_config.scheduling_settings)."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from pdmesh.shared.config import ConfigError
from pdmesh.shared.config.command_line import parse_command_line
from pdmesh.shared.config.engine_config import scheduling_settings
from pdmesh.shared.config.serve import read_config

SRF = {"scheduler_config": {"short_request_first_config": {
    "enabled": True, "threshold": 64, "long_max_wait_ms": 1500}}}


def settings(role: str, *flags: str) -> dict:
    flags = parse_command_line(role, ["--model", "m", *flags])
    return scheduling_settings(read_config(flags, device="cpu"))


NO_PRIORITY = {"priority_preemption_threshold": None, "default_priority": 0,
               "abort_on_priority_when_disabled": False}


def test_defaults_are_fcfs_without_a_limit():
    assert settings("prefill") == {"scheduling_policy": "fcfs",
                                   "priority_low_values_first": True,
                                   "max_queued_requests": None, **NO_PRIORITY}


@pytest.mark.parametrize(("flags", "low_first"), [
    (["--scheduling-policy", "priority"], True),  # vLLM: lower values first
    (["--enable-priority-scheduling"], False),  # SGLang: larger values first
    (["--enable-priority-scheduling", "--schedule-low-priority-values-first"], True),
    (["--enable-priority-scheduling", "--schedule-low-priority-values-first",
      "--scheduling-policy", "priority"], True),  # both families, agreeing
    (["--scheduling-policy", "priority", "--schedule-low-priority-values-first"], True),
])
def test_priority_order_follows_the_flag_family(flags, low_first):
    got = settings("decode", *flags)
    assert got["scheduling_policy"] == "priority"
    assert got["priority_low_values_first"] is low_first


@pytest.mark.parametrize(("flags", "threshold", "default"), [
    # SGLang's family: preemption past the threshold (10 unless given); a request
    # without a priority ranks last
    (["--enable-priority-scheduling"], 10, -sys.maxsize - 1),
    (["--enable-priority-scheduling", "--schedule-low-priority-values-first",
      "--priority-scheduling-preemption-threshold", "0"], 0, sys.maxsize),
    (["--enable-priority-scheduling", "--disable-priority-preemption",
      "--default-priority-value", "5"], None, 5),
    # vLLM's: no preemption of a running request for a waiting one; 0 by default
    (["--scheduling-policy", "priority"], None, 0),
    (["--scheduling-policy", "priority", "--default-priority-value", "-2"], None, -2),
])
def test_priority_preemption_and_default(flags, threshold, default):
    got = settings("decode", *flags)
    assert got["priority_preemption_threshold"] == threshold
    assert got["default_priority"] == default


def test_abort_on_priority_when_disabled_reaches_the_engine():
    assert settings("mixed", "--abort-on-priority-when-disabled")[
        "abort_on_priority_when_disabled"] is True


@pytest.mark.parametrize(("family", "flag"), [
    ([], ["--priority-scheduling-preemption-threshold", "3"]),
    (["--scheduling-policy", "priority"], ["--disable-priority-preemption"]),
])
def test_preemption_flags_without_sglang_priority_say_so(family, flag, caplog):
    cfg = read_config(parse_command_line("prefill", ["--model", "m", *family, *flag]),
                      device="cpu")
    assert cfg.flag_warnings == (f"{flag[0]}: without effect (priority preemption comes "
                                 "with --enable-priority-scheduling)",)
    with caplog.at_level(logging.WARNING):
        cfg.log_warnings()
    assert f"{flag[0]}: without effect" in caplog.text
    sglang = ["--model", "m", "--enable-priority-scheduling", *flag]
    assert read_config(parse_command_line("prefill", sglang), device="cpu").flag_warnings == ()


@pytest.mark.parametrize(("flags", "needle"), [
    (["--enable-priority-scheduling", "--priority-scheduling-preemption-threshold", "-1"],
     "--priority-scheduling-preemption-threshold: must be >= 0, got -1"),
    (["--schedule-low-priority-values-first"],
     "--schedule-low-priority-values-first: only with --enable-priority-scheduling"),
    (["--enable-priority-scheduling", "--scheduling-policy", "priority"],
     "--enable-priority-scheduling: serves larger priority values first"),
    (["--max-queued-requests", "0"], "--max-queued-requests: must be >= 1, got 0"),
])
def test_bad_flag_combinations_name_the_flag(flags, needle):
    with pytest.raises(ValueError, match=needle):
        settings("prefill", *flags)


@pytest.mark.parametrize("role", ["prefill", "mixed"])
def test_short_request_first_on_prefill_and_mixed(role):
    got = settings(role, "--additional-config", json.dumps(SRF), "--max-queued-requests", "8")
    assert got == {"scheduling_policy": "short_request_first",
                   "priority_low_values_first": True, "max_queued_requests": 8, **NO_PRIORITY,
                   "short_request_threshold": 64, "short_request_long_max_wait_ms": 1500.0}


def test_legacy_top_level_short_request_first_key():
    legacy = {"short_request_first_config": {"enabled": True, "threshold": 32}}
    got = settings("prefill", "--additional-config", json.dumps(legacy))
    assert got["scheduling_policy"] == "short_request_first"
    assert got["short_request_threshold"] == 32


@pytest.mark.parametrize(("role", "flags", "needle"), [
    ("decode", [], 'decode node (kv_role "kv_consumer")'),
    ("prefill", ["--enable-priority-scheduling"], "--enable-priority-scheduling"),
    ("mixed", ["--scheduling-policy", "priority"], "--scheduling-policy priority"),
])
def test_short_request_first_is_refused_on_decode_and_with_priorities(role, flags, needle):
    with pytest.raises(ConfigError) as info:
        settings(role, "--additional-config", json.dumps(SRF), *flags)
    assert info.value.keys == ("scheduler_config.short_request_first_config.enabled",)
    assert needle in str(info.value)
