"""Shared fixtures: tiny models made once per session, offline, from a fixed seed."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):
    # several workers on few cores (make test): torch at one thread in each worker and
    # in every service it starts, or their threads spin waiting for cores the others hold
    # (two workers at torch's default took 41 min of CPU for the suite's 17). Set before
    # torch is imported.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from pdmesh.shared.models.tiny import ARCHS, SIZES, make_tiny_model
from pdmesh.shared.models.tiny_tokenizer import DSV4_TOKENS, tokenizer_spec, train_tokenizer


@pytest.fixture(scope="session")
def registry_prefix() -> str:
    """A redis key prefix no other test run uses; its keys are deleted at the end."""
    import redis

    prefix = f"pdmesh-test-{uuid.uuid4().hex[:8]}"
    yield prefix
    r = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    for key in r.scan_iter(match=f"{prefix}:*"):
        r.delete(key)


@pytest.fixture(scope="session")
def bpe_tokenizer():
    return train_tokenizer(SIZES["tiny"].vocab)


@pytest.fixture(scope="session")
def dsv4_tokenizer():
    """The tiny DeepSeek-V4's: V4's BOS / EOS and chat markup as whole tokens."""
    return train_tokenizer(SIZES["tiny"].vocab, DSV4_TOKENS)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, bpe_tokenizer, dsv4_tokenizer) -> dict[str, Path]:
    """arch -> folder of a tiny random model (seed 0), for every architecture."""
    root = tmp_path_factory.mktemp("models")
    tokenizers = {DSV4_TOKENS: dsv4_tokenizer}
    return {arch: make_tiny_model(root / arch, arch, seed=0,
                                  tokenizer=tokenizers.get(tokenizer_spec(arch), bpe_tokenizer))
            for arch in ARCHS}


@pytest.fixture(scope="session")
def qwen3_path(tiny_models) -> Path:
    return tiny_models["qwen3"]


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    """A real mooncake_master (with its HTTP metadata server) on free loopback ports."""
    from pdmesh.shared.kvpool.master import MasterPorts, MasterSupervisor

    sup = MasterSupervisor(MasterPorts("127.0.0.1", 0, 0, 0),
                           log_path=str(tmp_path_factory.mktemp("mc") / "master.log"))
    sup.start()
    try:
        yield sup
    finally:
        sup.stop()
