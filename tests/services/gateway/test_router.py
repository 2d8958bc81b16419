"""Routing choices, from registry entries (the real redis, a unique prefix)."""

from __future__ import annotations

from collections import Counter

from services.gateway.router import Router
from shared.registry import Instance, Registry


def registry(prefix: str, *instances: Instance) -> Registry:
    reg = Registry(prefix=prefix)
    for inst in instances:
        reg.put(inst)
    return reg


def test_prefill_by_queued_tokens_then_requests(registry_prefix):
    reg = registry(registry_prefix + "-r1",
                   Instance("p1", "prefill", "a:1", load={"queued_prefill_tokens": 900}),
                   Instance("p2", "prefill", "a:2", load={"queued_prefill_tokens": 100,
                                                          "running": 5}),
                   Instance("p3", "prefill", "a:3", load={"queued_prefill_tokens": 100,
                                                          "running": 1}))
    r = Router(reg)
    assert r.pick("prefill").id == "p3"
    assert r.pick("prefill", exclude={"p3"}).id == "p2"
    assert r.pick("decode") is None


def test_decode_by_blocks_in_use_and_random_ties(registry_prefix):
    same = {"total_kv_blocks": 100, "free_kv_blocks": 60}
    reg = registry(registry_prefix + "-r2",
                   Instance("d1", "decode", "b:1", load=same),
                   Instance("d2", "decode", "b:2", load=same),
                   Instance("d3", "decode", "b:3", load={"total_kv_blocks": 100,
                                                         "free_kv_blocks": 10}))
    r = Router(reg)
    picks = Counter(r.pick("decode").id for _ in range(200))
    assert set(picks) == {"d1", "d2"}  # never the fuller d3; identical ones share the work
    assert min(picks.values()) > 50


def test_draining_instances_get_nothing(registry_prefix):
    reg = registry(registry_prefix + "-r3",
                   Instance("d1", "decode", "b:1", draining=True),
                   Instance("d2", "decode", "b:2"))
    assert {Router(reg).pick("decode").id for _ in range(20)} == {"d2"}


def test_only_instances_of_the_gateways_model(registry_prefix):
    reg = registry(registry_prefix + "-r4",
                   Instance("p1", "prefill", "a:1", model="other"),
                   Instance("p2", "prefill", "a:2", model="tiny"))
    assert {Router(reg, model="tiny").pick("prefill").id for _ in range(10)} == {"p2"}


def test_background_refresh_sees_new_instances(registry_prefix):
    import time

    reg = registry(registry_prefix + "-r5")
    r = Router(reg, refresh_s=0.05)
    r.start()
    assert r.pick("decode") is None
    reg.put(Instance("d9", "decode", "c:1"))
    r.forget()
    deadline = time.monotonic() + 5
    while r.pick("decode") is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert r.pick("decode").id == "d9"
