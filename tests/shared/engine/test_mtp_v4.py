"""DeepSeek-V4's MTP block as the proposer (``mtp.{i}``: e_proj / h_proj over the
target's streams, a sliding-window V4 layer with hyper-connections, its own head mix):
greedy output token-identical to decoding one token a step, under chunked prefill,
preemption and prefix caching; its window K=V one more tensor of the window group (that
it drafts as a fresh computation does: test_mtp.py); a block it cannot run is refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.models.deepseek_v4 import V4MtpWeights
from tests.shared.engine.spec_runs import assert_no_block_held, mixed_prompts, run
from tests.shared.engine.test_mtp import mtp


@pytest.fixture(scope="module")
def ds4(tiny_models):
    return tiny_models["deepseek_v4"]


@pytest.fixture(scope="module")
def reference(ds4):
    ps = mixed_prompts(9, seed=1, longest=120)
    params = [SamplingParams(temperature=0, max_tokens=16 + 4 * (i % 3), ignore_eos=True)
              for i in range(len(ps))]
    return ps, params, run(ds4, ps, params, dtype="float32")[0]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_is_token_identical(ds4, reference, k):
    ps, params, want = reference
    got, llm = run(ds4, ps, params, dtype="float32", speculative_config=mtp(k))
    assert got == want
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and len(stats.accepted_per_position) == k
    assert stats.num_draft_tokens > stats.num_drafts if k > 1 else True
    assert_no_block_held(llm)


def test_identical_under_chunked_prefill_preemption_and_prefix_caching(ds4, reference):
    ps, params, want = reference
    shared = [ps[0][:40] + p for p in ps[:3]]
    ref_shared = run(ds4, shared, params[:3], dtype="float32")[0]
    got, llm = run(ds4, ps + shared, params + params[:3], dtype="float32",
                   speculative_config=mtp(2), num_kv_blocks=24, max_num_batched_tokens=24,
                   max_num_seqs=6)
    assert got == want + ref_shared
    assert llm.engine.spec_stats.num_drafts > 0
    assert_no_block_held(llm)


def test_the_mtp_block_loads_as_its_own_layer_and_keeps_its_window_kv(ds4):
    """``mtp.0`` is read as a V4 layer of its own (sliding attention, its own head mix),
    and its window K=V is one more tensor of the window group, none of the history."""
    llm = LLM(str(ds4), device="cpu", block_size=16, dtype="float32",
              speculative_config=mtp(1))
    model = llm.engine.model
    m = model.w.mtp[0]
    assert isinstance(m, V4MtpWeights) and m.layer.attn.compressor is None
    assert not torch.equal(m.hc_head.fn, model.w.hc_head.fn)  # its own head mix
    layout = llm.engine.cache_spec.layout()
    n = llm.engine.model_config.num_layers
    window = layout.split(";")[1]
    assert window.startswith("window:sliding") and f"{n}.window." in window
    assert f"{n}." not in layout.split(";")[0]  # nothing in the compressed history


def _mtp_checkpoint_with(path, tmp_path, change) -> str:
    out = tmp_path / "ds4-changed"
    shutil.copytree(path, out)
    weights = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    change(weights, cfg)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def test_a_compressed_mtp_block_is_refused_by_name(ds4, tmp_path):
    def compressed(w: dict, cfg: dict) -> None:
        for key in [k for k in w if k.startswith("layers.1.attn.compressor.")]:
            w["mtp.0." + key.removeprefix("layers.1.")] = w[key].clone()

    path = _mtp_checkpoint_with(ds4, tmp_path, compressed)
    served = LLM(path, device="cpu", block_size=16)  # without MTP it serves
    assert served.engine.model.w.mtp == []
    with pytest.raises(ValueError, match="speculative_config.method: mtp: .*mtp.0 has "
                                         "compressed attention"):
        LLM(path, device="cpu", block_size=16, speculative_config=mtp(1))


def test_without_mtp_blocks_the_method_is_refused(ds4, tmp_path):
    def drop(w: dict, cfg: dict) -> None:
        for key in [k for k in w if k.startswith("mtp.")]:
            del w[key]

    path = _mtp_checkpoint_with(ds4, tmp_path, drop)
    with pytest.raises(ValueError, match="mtp needs the checkpoint's MTP layers"):
        LLM(path, device="cpu", block_size=16, speculative_config=mtp(1))


def test_a_block_with_its_own_head_and_embedding_reads_them(ds4, tmp_path):
    """Checkpoints converted with the MTP block's own copies (``mtp.0.head.weight``,
    ``mtp.0.emb.tok_emb.weight``) have them read; the official layout shares the
    model's."""
    shared = LLM(str(ds4), device="cpu", block_size=16, dtype="float32").engine.model.w
    assert shared.mtp[0].head is shared.lm_head and shared.mtp[0].embed is shared.embed

    def own(w: dict, cfg: dict) -> None:
        w["mtp.0.head.weight"] = w["head.weight"] * 2
        w["mtp.0.emb.tok_emb.weight"] = w["embed.weight"] + 1

    w = LLM(_mtp_checkpoint_with(ds4, tmp_path, own), device="cpu", block_size=16,
            dtype="float32").engine.model.w
    torch.testing.assert_close(w.mtp[0].head, 2 * w.lm_head)
    torch.testing.assert_close(w.mtp[0].embed, w.embed + 1)
