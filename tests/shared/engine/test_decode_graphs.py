"""Decode steps from captured graphs (shared/engine/decode_graphs.py): the capture sizes
and the flags that choose them, and the engine over a graph stand-in with a device
graph's contract (tests/shared/engine/graph_standin.py) - the npu backend over its
torch_npu stand-in, decode steps padded to their capture size and replayed piece by
piece, every token scored as the cpu backend scores it."""

from __future__ import annotations

import ast
import ctypes
import inspect
import logging
import zipfile

import pytest
import torch

import pdmesh.shared.engine.build as engine_build
import pdmesh.shared.engine.decode_graphs as decode_graphs
from pdmesh.shared.config.serve import serve_config
from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.engine.graph_config import GraphConfig, default_capture_sizes
from tests.shared.engine.graph_standin import CaptureError, RecordedGraph, standin_device
from tests.shared.engine.test_parity_hf import PROMPTS
from tests.shared.engine.test_standin_parity import worst_logprob_gap
from tests.shared.kernels.npu_standin import npu_backend, vendored_wheel


def test_default_capture_sizes_are_vllm_s():
    assert default_capture_sizes(512) == [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    # bounded by the batch the engine ever runs, and by max_cudagraph_capture_size
    assert GraphConfig.from_flags(10).sizes == (1, 2, 4, 8)
    assert GraphConfig.from_flags(256).sizes[-1] == 256
    assert GraphConfig.from_flags(1024).sizes[-1] == 512
    assert GraphConfig.from_flags(
        256, compilation_config={"max_cudagraph_capture_size": 20}).sizes == (1, 2, 4, 8, 16)


def test_a_step_pads_to_the_next_capture_size():
    config = GraphConfig.from_flags(64, compilation_config={"cudagraph_capture_sizes": [8, 2,
                                                                                       4]})
    assert config.sizes == (2, 4, 8)
    assert [config.size_for(b) for b in (1, 2, 3, 5, 8, 9)] == [2, 2, 4, 8, 8, None]
    exact = GraphConfig.from_flags(64, compilation_config={"cudagraph_capture_sizes": [2, 4]},
                                   disable_padding=True)
    assert [exact.size_for(b) for b in (1, 2, 3, 4)] == [None, 2, None, 4]


def _engine(*words: str):
    return serve_config("mixed", ["/models/x", "--device", "cpu", *words]).engine


def test_the_flags_choose_what_is_captured():
    assert _engine().graph_config().enabled
    assert not _engine("--enforce-eager").graph_config().enabled
    assert not _engine("--disable-cuda-graph").graph_config().enabled
    assert _engine("--compilation-config", '{"cudagraph_capture_sizes": [1, 3, 5]}'
                   ).graph_config().sizes == (1, 3, 5)
    assert not _engine("--compilation-config", '{"cudagraph_mode": "NONE"}'
                       ).graph_config().enabled
    # SGLang's spellings; vLLM's keys win where both are given
    assert _engine("--cuda-graph-bs", "2", "6").graph_config().sizes == (2, 6)
    assert _engine("--cuda-graph-bs", "2", "6", "--compilation-config",
                   '{"cudagraph_capture_sizes": [4]}').graph_config().sizes == (4,)
    assert _engine("--cuda-graph-max-bs", "16").graph_config().sizes == (1, 2, 4, 8, 16)
    assert not _engine("--disable-cuda-graph-padding").graph_config().pad
    # the seeds' line: FULL_DECODE_ONLY, said to be captured piecewise
    seeds = _engine("--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY"}'
                    ).graph_config()
    assert seeds.enabled and any("piecewise" in w for w in seeds.warnings)
    # keys that only torch.compile reads are listed without effect
    assert any("without effect" in w and "level" in w for w in _engine(
        "--compilation-config", '{"level": 3}').graph_config().warnings)
    # ... and at start-up (config check too): on a cpu, the graph flags as a whole
    said = serve_config("mixed", ["/models/x", "--device", "cpu", "--cuda-graph-bs", "2"])
    assert any("without effect on cpu" in w for w in said.flag_warnings)
    assert not any("graph" in w for w in serve_config(
        "mixed", ["/models/x", "--device", "cpu"]).flag_warnings)


@pytest.mark.parametrize(("words", "field"), [
    (("--compilation-config", '{"cudagraph_mode": "SOMETIMES"}'),
     "--compilation-config.cudagraph_mode"),
    (("--compilation-config", '{"cudagraph_capture_sizes": [0, 2]}'),
     "--compilation-config.cudagraph_capture_sizes"),
    (("--compilation-config", '{"cudagraph_capture_sizes": "8"}'),
     "--compilation-config.cudagraph_capture_sizes"),
    (("--compilation-config", '{"max_cudagraph_capture_size": -1}'),
     "--compilation-config.max_cudagraph_capture_size"),
    (("--cuda-graph-bs", "two"), "--cuda-graph-bs"),
])
def test_a_bad_graph_setting_is_refused_by_name(words, field):
    with pytest.raises(ValueError, match="^" + field.replace(".", r"\.") + ": "):
        _engine(*words)


def test_the_stand_in_keeps_a_device_graph_s_contract():
    """Capturing computes nothing and refuses host reads; a replay reads its inputs
    afresh and writes the tensors the capture handed out; writes into arguments wait
    for the replay."""
    x = torch.ones(4)
    acc = torch.zeros(4)
    g = RecordedGraph()
    with torch.inference_mode():
        g.capture_begin()
        try:
            y = x * 2 + 1
            acc.add_(y)
            with pytest.raises(CaptureError, match="host read"):
                y.sum().item()
            with pytest.raises(CaptureError, match="host read"):
                y.tolist()
        finally:
            g.capture_end()
    assert torch.isnan(y).all() and (acc == 0).all()  # nothing ran
    x.copy_(torch.arange(4.0))
    g.replay()
    assert y.tolist() == [1.0, 3.0, 5.0, 7.0] and acc.tolist() == y.tolist()
    g.replay()
    assert acc.tolist() == [2.0, 6.0, 10.0, 14.0]


def _graphs_over_standins(monkeypatch, backend):
    monkeypatch.setattr(decode_graphs.GraphDevice, "of", staticmethod(
        lambda device: standin_device()))
    monkeypatch.setattr(engine_build, "get_backend", lambda device: backend)


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3", "deepseek_v4"])
def test_decode_from_graphs_scores_as_the_cpu_backend(tiny_models, monkeypatch, arch):
    """The npu backend (over its torch_npu stand-in, float32 let through as
    test_standin_parity does) with its decode steps from graphs: 5 prompts decode in
    steps of 5 sequences padded to 8, captured once and replayed, the cache writes,
    attention (MLA's too) and the routed experts between the pieces; every token,
    prompt and generated, scores as the cpu backend scores it."""
    path = str(tiny_models[arch])
    cpu = LLM(path, device="cpu", dtype="float32", block_size=128)
    backend = npu_backend()
    monkeypatch.setitem(type(backend).rms_norm.__globals__, "_HALF",
                        (torch.float16, torch.bfloat16, torch.float32))
    monkeypatch.setattr(type(backend), "_fia_ok", staticmethod(lambda q, kv_dtype, kvh: True))
    _graphs_over_standins(monkeypatch, backend)
    llm = LLM(path, device="cpu", dtype="float32", block_size=128,
              compilation_config={"cudagraph_capture_sizes": [2, 4, 8]})
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    worst = worst_logprob_gap(llm, cpu)
    assert graphs.disabled is None, graphs.disabled
    assert graphs.sizes == [(8, 1)] and graphs.replays >= 7, (graphs.sizes, graphs.replays)
    assert worst < 1e-3, worst


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_verify_steps_replay_too(tiny_models, monkeypatch, arch):
    """The seeds' MTP line (one draft a step): each decode step verifies one draft per
    sequence - 2 tokens each, attention through the prefill path over the paged cache -
    and replays from its graph (5 sequences padded to 8, x 2 tokens); the MTP layer
    continues from the replay's hidden states; the greedy output is the target's, as
    decoding one token a step eagerly gives it."""
    path = str(tiny_models[arch])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, device="cpu", dtype="float32",
                                                enforce_eager=True).generate(PROMPTS, params)]
    backend = npu_backend()
    monkeypatch.setitem(type(backend).rms_norm.__globals__, "_HALF",
                        (torch.float16, torch.bfloat16, torch.float32))
    monkeypatch.setattr(type(backend), "_fia_ok", staticmethod(lambda q, kv_dtype, kvh: True))
    _graphs_over_standins(monkeypatch, backend)
    llm = LLM(path, device="cpu", dtype="float32",
              compilation_config={"cudagraph_capture_sizes": [8]},
              speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1,
                                  "adaptive_drafts": False})
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    graphs = llm.engine.runner.graphs
    assert graphs.disabled is None, graphs.disabled
    assert (8, 2) in graphs.sizes and graphs.replays >= 3, (graphs.sizes, graphs.replays)
    assert llm.engine.spec_stats.num_drafts > 0
    assert got == want


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3", "deepseek_v4"])
def test_an_int8_kv_cache_decodes_from_graphs_as_eagerly(tiny_models, monkeypatch, arch):
    """The int8 cache's writes (values and scales) and reads run between the pieces:
    the same greedy tokens as the same backend decoding eagerly."""
    _graphs_over_standins(monkeypatch, npu_backend())
    assert_replayed_as_eagerly(str(tiny_models[arch]), kv_cache_dtype="int8")


@pytest.mark.parametrize(("arch", "scheme"), [("qwen3_moe", "w8a8_dynamic"), ("qwen3", "w8a8")])
def test_a_quantized_model_decodes_from_graphs_as_eagerly(tiny_models, tmp_path, monkeypatch,
                                                         arch, scheme):
    """The npu backend's quantized projections (npu_dynamic_quant / npu_quantize /
    npu_quant_matmul over the stand-in) replay inside the pieces, the int8 experts run
    between them: the same greedy tokens as the same backend decoding eagerly."""
    from pdmesh.shared.cli.quantize import quantize_checkpoint

    path = str(tmp_path / scheme)
    quantize_checkpoint(tiny_models[arch], path, scheme)
    _graphs_over_standins(monkeypatch, npu_backend())
    assert_replayed_as_eagerly(path, quantization="ascend")


def assert_replayed_as_eagerly(path: str, **engine_args) -> None:
    """3 prompts, 8 greedy tokens: decode from graphs (size 4, every step replayed)
    gives the tokens the same engine gives eagerly."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(
        path, device="cpu", dtype="bfloat16", enforce_eager=True,
        **engine_args).generate(PROMPTS[:3], params)]
    llm = LLM(path, device="cpu", dtype="bfloat16",
              compilation_config={"cudagraph_capture_sizes": [4]}, **engine_args)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params)]
    graphs = llm.engine.runner.graphs
    assert graphs.disabled is None and graphs.sizes == [(4, 1)], graphs.disabled
    assert graphs.replays == 7 and got == want


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v4"])
def test_tensor_parallel_ranks_capture_and_replay_together(tiny_models, monkeypatch, arch):
    """Two tensor-parallel ranks (gloo), each with the npu backend over the stand-ins:
    both capture the same steps, their all-reduces and gathers inside the pieces, replay
    them together (the verdicts joined), and give the tokens the same ranks give
    eagerly."""
    import pdmesh.shared.engine.tp_worker as tp_worker
    from tests.shared.engine.graph_standin import standin_tp_worker

    path = str(tiny_models[arch])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    _graphs_over_standins(monkeypatch, npu_backend())
    monkeypatch.setattr(tp_worker, "tensor_parallel_worker", standin_tp_worker)
    eager = LLM(path, device="cpu", dtype="bfloat16", tensor_parallel_size=2,
                enforce_eager=True)
    try:
        want = [o.outputs[0].token_ids for o in eager.generate(PROMPTS[:3], params)]
    finally:
        eager.close()
    llm = LLM(path, device="cpu", dtype="bfloat16", tensor_parallel_size=2,
              compilation_config={"cudagraph_capture_sizes": [4]})
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params)]
        graphs = llm.engine.runner.graphs
        assert graphs.disabled is None, graphs.disabled
        assert graphs.sizes == [(4, 1)] and graphs.replays == 7
    finally:
        llm.close()
    assert got == want


def test_a_capture_that_fails_on_one_rank_is_dropped_by_all(tiny_models, monkeypatch):
    """Rank 0's capture reads the host (refused), its worker's succeeds: the verdicts
    joined, both drop it - neither waits in a collective the other never makes - and
    decode goes on eagerly with the same tokens."""
    import pdmesh.shared.engine.tp_worker as tp_worker
    from tests.shared.engine.graph_standin import standin_tp_worker

    path = str(tiny_models["qwen3"])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    backend = npu_backend()
    norm = backend.rms_norm

    def reads_the_host(x, weight, eps):
        assert x.abs().max().item() >= 0
        return norm(x, weight, eps)

    _graphs_over_standins(monkeypatch, backend)
    monkeypatch.setattr(tp_worker, "tensor_parallel_worker", standin_tp_worker)
    eager = LLM(path, device="cpu", dtype="bfloat16", tensor_parallel_size=2,
                enforce_eager=True)
    try:
        want = [o.outputs[0].token_ids for o in eager.generate(PROMPTS[:2], params)]
    finally:
        eager.close()
    backend.rms_norm = reads_the_host  # (rank 0 only: the worker has its own backend)
    llm = LLM(path, device="cpu", dtype="bfloat16", tensor_parallel_size=2,
              compilation_config={"cudagraph_capture_sizes": [2]})
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)]
        graphs = llm.engine.runner.graphs
        assert "host read" in graphs.disabled and graphs.replays == 0
    finally:
        llm.close()
    assert got == want


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v4"])
def test_expert_parallel_ranks_replay_their_own_steps(tiny_models, arch):
    """Two expert-parallel DP ranks in lockstep (gloo), with different numbers of
    sequences (3 and 1, so sizes 4 and 1, and the idle rank's empty forwards): each
    replays its decode steps, the experts' exchange between the pieces pairing with the
    other rank's; a capture's warm-up and check leave the exchange out, so neither rank
    waits for the other there. The tokens, and the expert load recorded for EPLB, are
    those of the same ranks decoding eagerly."""
    from pdmesh.shared.parallel.ranks import run_ranks
    from tests.shared.engine.graph_standin import standin_ep_rank

    path = str(tiny_models[arch])
    shares = [PROMPTS[:3], PROMPTS[3:4]]
    eager = run_ranks(standin_ep_rank, 2, path, shares, False, timeout_s=240)
    graphs = run_ranks(standin_ep_rank, 2, path, shares, True, timeout_s=240)
    for rank in (0, 1):
        tokens, replays, disabled, load = graphs[rank]
        assert disabled is None, disabled
        assert replays == 7, (rank, replays)
        assert tokens == eager[rank][0]
        # EPLB's record counts the step's rows alone, never a capture's or the padding
        assert load == eager[rank][3] and sum(map(sum, load)) > 0


FINE_ALL = {"embedding_tensor_parallel_size": 2, "lmhead_tensor_parallel_size": 2,
            "oproj_tensor_parallel_size": 2, "mlp_tensor_parallel_size": 2}


@pytest.mark.parametrize(("arch", "ep"), [("qwen3", False), ("deepseek_v4", True)])
def test_fine_grained_tp_ranks_replay_one_size_together(tiny_models, arch, ep):
    """Two DP ranks with every fine-grained TP key (embedding, o_proj, dense MLP and
    lm_head split over both; DeepSeek-V4 with expert parallelism too, its o_proj its
    wo_b, replayed, its attention a hole the idle rank skips), 3 sequences and 1
    (which stops early, so its rank idles while the other decodes): the split modules'
    gathers and all-to-alls are inside the pieces, so both ranks replay the size the
    larger step needs (4), the idle rank its empty forward too; the tokens are those of
    the same ranks decoding eagerly."""
    from pdmesh.shared.parallel.ranks import run_ranks
    from tests.shared.engine.graph_standin import standin_ep_rank

    path = str(tiny_models[arch])
    shares = [PROMPTS[:3], PROMPTS[3:4]]
    eager = run_ranks(standin_ep_rank, 2, path, shares, False, FINE_ALL, ep, (8, 3),
                      timeout_s=240)
    graphs = run_ranks(standin_ep_rank, 2, path, shares, True, FINE_ALL, ep, (8, 3),
                       timeout_s=240)
    for rank in (0, 1):
        tokens, replays, disabled, _ = graphs[rank]
        assert disabled is None, disabled
        # 7 decode steps after the prefill: the idle rank's forwards replay as well
        assert replays == 7, (rank, replays)
        assert tokens == eager[rank][0] and all(tokens), (rank, tokens)


def test_graphs_are_captured_again_when_the_kv_cache_changes(tiny_models, monkeypatch):
    """A capture holds the cache tensors it was given: new ones (a cache rebuilt) drop
    every size, which is captured again on the new tensors, and decode goes on right."""
    path = str(tiny_models["qwen3"])
    _graphs_over_standins(monkeypatch, npu_backend())
    llm = LLM(path, device="cpu", dtype="bfloat16", block_size=128,
              compilation_config={"cudagraph_capture_sizes": [1]})
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = llm.generate([PROMPTS[2]], params)[0].outputs[0].token_ids
    graphs = llm.engine.runner.graphs
    assert graphs.captures == 1 and graphs.replays == 5
    layer = llm.engine.runner.kv_caches[0]
    role = next(iter(layer))
    layer[role] = layer[role].clone()  # the same content in new memory
    again = llm.generate([PROMPTS[2]], params)[0].outputs[0].token_ids
    assert graphs.captures == 2 and graphs.replays == 10
    assert again == first
    graphs.invalidate()  # (what a change of weights calls)
    assert graphs.sizes == [] and llm.generate([PROMPTS[2]], params)[0].outputs[0].token_ids \
        == first and graphs.captures == 3


def test_a_capture_that_reads_the_host_runs_eagerly_instead(tiny_models, monkeypatch,
                                                           caplog):
    """A piece that reads a value on the host (here an rms_norm that asks .item()) cannot
    be captured: the engine says so once and decodes eagerly, with the same tokens."""
    path = str(tiny_models["qwen3"])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = LLM(path, device="cpu", dtype="bfloat16", enforce_eager=True).generate(
        [PROMPTS[1]], params)[0].outputs[0].token_ids
    assert LLM(path, device="cpu", dtype="bfloat16").engine.runner.graphs is None  # (cpu)
    backend = npu_backend()
    norm = backend.rms_norm

    def reads_the_host(x, weight, eps):
        assert x.abs().max().item() >= 0
        return norm(x, weight, eps)

    backend.rms_norm = reads_the_host
    _graphs_over_standins(monkeypatch, backend)
    with caplog.at_level(logging.WARNING, logger="pdmesh.shared.engine.decode_graphs"):
        llm = LLM(path, device="cpu", dtype="bfloat16")
        got = llm.generate([PROMPTS[1]], params)[0].outputs[0].token_ids
    graphs = llm.engine.runner.graphs
    assert "host read" in graphs.disabled and graphs.replays == 0
    assert sum("decode runs eagerly" in r.getMessage() for r in caplog.records) == 1
    assert got == want

    # a copy made outside torch's dispatch (as a C kernel called by address would make
    # it) is no op a device graph records: the replay is checked against the eager
    # forward and turned down
    backend = npu_backend()
    norm = backend.rms_norm

    def copies_by_address(x, weight, eps):
        y = norm(x, weight, eps)
        out = torch.empty_like(y)
        ctypes.memmove(out.data_ptr(), y.data_ptr(), y.numel() * y.element_size())
        return out

    backend.rms_norm = copies_by_address
    _graphs_over_standins(monkeypatch, backend)
    llm = LLM(path, device="cpu", dtype="bfloat16")
    got = llm.generate([PROMPTS[1]], params)[0].outputs[0].token_ids
    assert "differs from the eager forward" in llm.engine.runner.graphs.disabled
    assert got == want


def test_the_cpu_backend_s_pieces_replay_too(tiny_models, monkeypatch):
    """The cpu backend's C kernels are its attention (between the pieces): its pieces are
    torch ops, and over the stand-in its decode replays as it runs eagerly - though a CPU
    has no graphs to capture, so `pdmesh` never asks it to."""
    from pdmesh.shared.kernels.cpu import CPUBackend

    path = str(tiny_models["qwen3"])
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, device="cpu", dtype="bfloat16").generate(
        PROMPTS[:3], params)]
    _graphs_over_standins(monkeypatch, CPUBackend(torch.device("cpu")))
    llm = LLM(path, device="cpu", dtype="bfloat16",
              compilation_config={"cudagraph_capture_sizes": [4]})
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params)]
    graphs = llm.engine.runner.graphs
    assert graphs.disabled is None and graphs.replays == 4
    assert got == want


def test_the_graph_apis_called_exist_as_called():
    """What GraphDevice.of calls - the graph class, its capture_begin's ``pool``,
    capture_end, replay, graph_pool_handle, Stream(device=), stream, synchronize - in
    torch.cuda, and in torch.npu as torch-npu 2.14's wheel defines it (read, not
    imported: it needs CANN)."""
    names = ("graph_pool_handle", "Stream", "stream", "synchronize")
    for name in ("CUDAGraph", *names):
        assert hasattr(torch.cuda, name), name
    params = inspect.signature(torch.cuda.CUDAGraph.capture_begin).parameters
    assert {"pool", "capture_error_mode"} <= set(params)
    assert {"capture_end", "replay"} <= set(dir(torch.cuda.CUDAGraph))
    assert "device" in inspect.signature(torch.cuda.Stream.__new__).parameters

    with zipfile.ZipFile(vendored_wheel()) as wheel:
        init = ast.parse(wheel.read("torch_npu/npu/__init__.py"))
        graphs = ast.parse(wheel.read("torch_npu/npu/graphs.py"))
        streams = ast.parse(wheel.read("torch_npu/npu/streams.py"))
    exported = next(ast.literal_eval(node.value) for node in init.body
                    if isinstance(node, ast.Assign)
                    and any(getattr(t, "id", None) == "__all__" for t in node.targets))
    assert {"NPUGraph", *names} <= set(exported)

    def methods(tree: ast.Module, cls: str) -> dict[str, list[str]]:
        [node] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
        return {f.name: [a.arg for a in f.args.args] for f in node.body
                if isinstance(f, ast.FunctionDef)}

    npu_graph = methods(graphs, "NPUGraph")
    assert {"pool", "capture_error_mode"} <= set(npu_graph["capture_begin"])
    assert {"capture_end", "replay"} <= set(npu_graph)
    assert "device" in methods(streams, "Stream")["__new__"]
