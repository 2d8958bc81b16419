"""LoRA adapters on Llama through the whole PD mesh (the Qwen3, Qwen3-MoE, DeepSeek-V3
and DeepSeek-V4 meshes check theirs beside their other tests): three adapters loaded at
runtime and the base model in one batch through prefill, the Mooncake pool and decode,
token for token transformers + PEFT's."""

from __future__ import annotations

import json

import pytest

from tests.mesh import MODEL, pd_mesh
from tests.services.pd.lora_mesh import mixed_batch


@pytest.fixture(scope="module")
def mesh(tiny_models, tmp_path_factory, registry_prefix):
    lora = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "8"]
    with pd_mesh(tiny_models["llama"], tmp_path_factory.mktemp("llama-pd"),
                 f"{registry_prefix}-llama", prefill_args=lora, decode_args=lora) as services:
        yield services


def test_a_batch_mixing_three_adapters_and_the_base_matches_peft(mesh, tiny_models, tmp_path):
    got, want = mixed_batch(mesh["gateway"].info["http"], MODEL, tiny_models["llama"],
                            "llama", tmp_path)
    assert len({json.dumps(want[k]) for k in (0, 3, 4)}) == 3  # each adapter tells
    assert got == want
