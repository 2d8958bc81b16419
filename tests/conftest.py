"""Shared fixtures: tiny models made once per session, offline, from a fixed seed."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.models.tiny import ARCHS, SIZES, make_tiny_model, train_tokenizer


@pytest.fixture(scope="session")
def bpe_tokenizer():
    return train_tokenizer(SIZES["tiny"].vocab)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, bpe_tokenizer) -> dict[str, Path]:
    """arch -> folder of a tiny random model (seed 0), for every architecture."""
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch, seed=0, tokenizer=bpe_tokenizer)
            for arch in ARCHS}


@pytest.fixture(scope="session")
def qwen3_path(tiny_models) -> Path:
    return tiny_models["qwen3"]
