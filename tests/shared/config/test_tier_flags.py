"""The KV tiers' flags on an instance's command line (config/tier_flags.py): SGLang's
HiCache flags and vLLM's --kv-offloading-size reach the engine; given without the tiers,
or pool flags a mixed instance has no use for, they are said to be without effect."""

from __future__ import annotations

from pdmesh.shared.config.serve import serve_config
from pdmesh.shared.runtime.engine_service import wants_pool


def config(role: str, *flags: str):
    return serve_config(role, ["/m", *flags], device="cpu")


def said(cfg, text: str) -> bool:
    return any(text in w for w in cfg.flag_warnings)


def test_sglangs_and_vllms_spellings_reach_the_engine():
    tiers = config("mixed", "--enable-hierarchical-cache", "--hicache-size", "2",
                   "--hicache-write-policy", "write_back", "--hicache-storage-backend",
                   "file", "--hicache-storage-prefetch-policy", "wait_complete").engine.kv_tiers
    assert (tiers.host_bytes, tiers.write_policy, tiers.storage, tiers.prefetch_policy) == (
        2 * 10**9, "write_back", "file", "wait_complete")
    assert config("mixed", "--kv-offloading-size", "1.5").engine.kv_tiers.host_bytes == \
        int(1.5 * (1 << 30))
    assert config("mixed").engine.kv_tiers is None


def test_flags_without_their_switch_or_their_pool_are_said():
    off = config("mixed", "--hicache-size", "2", "--kvstore", "127.0.0.1:1",
                 "--kv-load-timeout", "3")
    assert said(off, "--hicache-size: without effect (the KV tiers are off")
    assert said(off, "--kvstore, --kv-load-timeout: without effect on a mixed instance")
    # with tiers, a mixed instance reads them under --kv-load-timeout; a pool only as
    # their Mooncake storage
    host = config("mixed", "--enable-hierarchical-cache", "--kv-load-timeout", "3",
                  "--kvstore", "127.0.0.1:1")
    assert said(host, "--kvstore: without effect on a mixed instance")
    assert host.engine.kv_load_timeout_s == 3 and not wants_pool("mixed", host.engine)
    mooncake = config("mixed", "--enable-hierarchical-cache", "--hicache-storage-backend",
                      "mooncake", "--kvstore", "127.0.0.1:1", "--pool-segment-mb", "64")
    assert not said(mooncake, "on a mixed instance") and wants_pool("mixed", mooncake.engine)
    prefill = config("prefill", "--kvstore", "127.0.0.1:1", "--kv-load-timeout", "3")
    assert not said(prefill, "without effect") and wants_pool("prefill", prefill.engine)
