"""The redis registry against the real redis on loopback, under a unique key prefix."""

from __future__ import annotations

import time

import pytest

from pdmesh.shared.infra.registry import Heartbeat, Instance, Registry


def test_register_heartbeat_expire(registry_prefix):
    reg = Registry(prefix=registry_prefix + "-a", ttl_s=0.5)
    inst = Instance("decode-1", "decode", "127.0.0.1:1", "m", load={"running": 3})
    reg.put(inst)
    [got] = reg.instances()
    assert (got.role, got.address, got.model, got.load["running"]) == ("decode", "127.0.0.1:1",
                                                                      "m", 3)
    assert reg.instances(role="prefill") == []
    time.sleep(0.8)  # no heartbeat: the key expires and the instance drops out
    assert reg.instances() == []


def test_heartbeat_thread_keeps_it_alive_and_deregisters(registry_prefix):
    reg = Registry(prefix=registry_prefix + "-b", ttl_s=0.6)
    calls = []
    beat = Heartbeat(reg, Instance("prefill-1", "prefill", "127.0.0.1:2"),
                     load=lambda: calls.append(1) or {"waiting": len(calls)}, every_s=0.1)
    beat.start()
    try:
        time.sleep(1.0)
        [got] = reg.instances()
        assert got.load["waiting"] >= 5
    finally:
        beat.stop()
    assert reg.instances() == []


def test_bad_role_is_refused(registry_prefix):
    with pytest.raises(ValueError, match="role"):
        Registry(prefix=registry_prefix).put(Instance("x", "router", "a"))


def test_prefixes_keep_meshes_apart(registry_prefix):
    a, b = Registry(prefix=registry_prefix + "-c"), Registry(prefix=registry_prefix + "-d")
    a.put(Instance("prefill-9", "prefill", "h:1"))
    assert [i.id for i in a.instances()] == ["prefill-9"] and b.instances() == []
