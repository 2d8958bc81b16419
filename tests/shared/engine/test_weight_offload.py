"""--cpu-offload-gb: the first layers that fit the budget live in host memory and are
copied to the device as each forward reaches them; the answers do not change. Run on
every device present (on cpu the copy is to the same memory: the streaming path all the
same), and said to be without effect where the engine runs on cpu."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from pdmesh.shared.config.serve import serve_config
from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.engine.weight_offload import StreamedLayers, map_weights, offload_layers
from pdmesh.shared.kernels import available_devices
from pdmesh.shared.models.transformer import weight_bytes

PROMPTS = [list(range(30, 70)), [5, 6, 7, 8, 9]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("device", available_devices())
@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v4"])
def test_offloaded_layers_stream_and_keep_the_answers(tiny_models, device, arch):
    llm = LLM(str(tiny_models[arch]), device=device, dtype="float32", block_size=16,
              enforce_eager=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    model = llm.engine.model
    one = weight_bytes(model.w.layers[0])
    moved = offload_layers(model, int(2.5 * one), device)
    layers = model.w.layers
    assert isinstance(layers, StreamedLayers) and layers.offloaded == {0, 1}
    assert moved == weight_bytes([list.__getitem__(layers, i) for i in (0, 1)])
    for i in (0, 1):  # kept in host memory, handed out on the device
        host = list.__getitem__(layers, i)
        assert all(t.device.type == "cpu" for t in _tensors(host))
        assert all(t.device.type == torch.device(device).type for t in _tensors(layers[i]))
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == want


def _tensors(obj) -> list[torch.Tensor]:
    from pdmesh.shared.models.transformer import weight_tensors

    return weight_tensors(obj)


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def test_map_weights_reaches_every_tensor_once():
    t = torch.ones(2)
    tree = {"x": [t, Pair(t, torch.zeros(1))], "y": (t,)}
    calls = []

    def double(x):
        calls.append(x)
        return x * 2

    out = map_weights(tree, double)
    assert len(calls) == 2  # t once, however often it is reached
    assert out["x"][0] is out["x"][1].a is out["y"][0] and isinstance(out["x"][1], Pair)
    assert torch.equal(out["x"][0], torch.full((2,), 2.0))
    layers = StreamedLayers([{"w": torch.ones(1)}] * 3, {0, 2}, "cpu")
    assert len(layers[-1:]) == 1 and len(list(layers)) == 3


def test_every_command_reads_it():
    base = ["--role", "mixed", "--model", "/tmp/m"]
    cpu = serve_config("config check", [*base, "--device", "cpu", "--cpu-offload-gb", "2"])
    assert cpu.engine.cpu_offload_gb == 2.0
    assert any("--cpu-offload-gb: without effect on cpu" in w for w in cpu.flag_warnings)
    cuda = serve_config("config check", [*base, "--device", "cuda", "--cpu-offload-gb", "2"],
                        device="cuda")
    assert cuda.engine.graph_config().mode == "NONE"  # (each forward copies layers over)
    assert any("decode graphs off" in w for w in cuda.flag_warnings)
    with pytest.raises(ValueError, match="^--cpu-offload-gb: not with tensor parallelism"):
        serve_config("config check", [*base, "--device", "cpu", "--cpu-offload-gb", "2",
                                      "-tp", "2"])
