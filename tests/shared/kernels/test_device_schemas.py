"""Every torch_npu call in pdmesh against the op schemas torch-npu's wheel ships, and the
cuda backend's device calls against torch's own (shared/kernels/device_schemas.py): ops
that exist, arguments that fit, results unpacked as returned. The wheel is fetched by
`make install` (scripts/setup.sh) into .cache/vendor and only read here."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from pdmesh.shared.kernels.device_schemas import (
    Call,
    calls_in,
    check,
    npu_schemas,
    parse_atb,
    parse_aten,
    torch_schemas,
)

ROOT = Path(__file__).resolve().parents[3]
# the npu backend's ops (and the ATB ones it calls privately), each at least once
NPU_OPS = {"npu_rms_norm", "npu_add_rms_norm", "npu_rotary_mul", "_npu_reshape_and_cache",
           "npu_fused_infer_attention_score", "_npu_reshape_and_cache_siso",
           "_npu_paged_attention_mla", "npu_swiglu", "npu_moe_gating_top_k_softmax",
           "npu_moe_gating_top_k", "npu_dynamic_quant", "npu_quant_matmul", "npu_quantize",
           "npu_grouped_matmul", "npu_top_k_top_p"}
# the cuda backend: torch's functions it calls, and varlen_attn kept as self._flash
VARLEN = "torch.nn.attention.varlen.varlen_attn"
CUDA_OPS = {"torch._int_mm", "torch.nn.functional.scaled_mm", "torch.nn.functional.rms_norm",
            VARLEN}


@pytest.fixture(scope="module")
def npu() -> dict:
    wheels = sorted((ROOT / ".cache" / "vendor").glob("torch_npu-*.whl"))
    if not wheels:
        pytest.fail("torch-npu's wheel is not in .cache/vendor: run `make install`")
    return npu_schemas(wheels[-1])


def npu_calls() -> list[Call]:
    calls = []
    for folder in ("shared", "services"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            calls += calls_in(f.read_text(), str(f.relative_to(ROOT)), {"torch_npu": "npu"})
    return calls


def torch_op(label: str) -> list:
    module, _, name = label.rpartition(".")
    try:
        return torch_schemas(getattr(importlib.import_module(module), name))
    except (ImportError, AttributeError):
        return []


def test_every_torch_npu_call_fits_its_schema(npu):
    calls = npu_calls()
    assert {c.op.split(".", 1)[1] for c in calls} >= NPU_OPS  # (found, not vacuous)
    assert check(calls, lambda op: npu.get(op.split(".", 1)[1], [])) == []


def test_the_cuda_backend_s_calls_fit_torch_s_schemas():
    src = (ROOT / "shared" / "kernels" / "cuda.py").read_text()
    calls = calls_in(src, "shared/kernels/cuda.py", {"torch": "torch",
                                                     "F": "torch.nn.functional"},
                     {"self._flash": VARLEN})
    assert {c.op for c in calls} >= CUDA_OPS
    assert check(calls, torch_op) == []


def test_the_check_catches_a_wrong_call(npu):
    """The test of the test: each kind of mistake, in calls pdmesh makes, is named."""
    def problems(line: str) -> list[str]:
        calls = calls_in(line, "x.py", {"torch_npu": "npu"})
        return check(calls, lambda op: npu.get(op.split(".", 1)[1], []))

    assert problems("torch_npu.npu_rms_norm(x, w, epsilon=1e-6)") == []
    [wrong] = problems("torch_npu.npu_rms_norm(x, w, eps=1e-6)")
    assert "no parameter 'eps'" in wrong and "x.py:1" in wrong
    assert "positional arguments" in problems("torch_npu.npu_rms_norm(x, w, 1e-6, 2)")[0]
    assert "required gamma" in problems("torch_npu.npu_rms_norm(x)")[0]
    assert "given by position and by keyword" in problems(
        "torch_npu.npu_rms_norm(x, w, gamma=w)")[0]
    assert "unpacked into 3" in problems("a, b, c = torch_npu.npu_rms_norm(x, w)")[0]
    assert "no such op" in problems("torch_npu.npu_rms_norm_v9(x, w)")[0]
    # an ATB op: C++ parameters, all required, returns nothing
    assert "required out" in problems(
        "torch_npu._npu_paged_attention_mla(query=q, key_cache=c, num_kv_heads=1, "
        "num_heads=8, scale_value=0.1, block_table=t, context_lens=n, mla_vheadsize=4)")[0]
    # a keyword only by keyword: FIA's actual_seq_lengths follows its "*"
    assert "positional arguments" in problems(
        "torch_npu.npu_fused_infer_attention_score(q, k, v, None, None, [1])")[0]
    # *args: counts unknown, names still checked
    assert problems("torch_npu.npu_rms_norm(*xs)") == []
    assert "no parameter 'eps'" in problems("torch_npu.npu_rms_norm(*xs, eps=1)")[0]


def test_the_declarations_are_read_as_written():
    s = parse_aten("npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, "
                   "int[2] dims=[1, 2], str quant_mode=\"per, token\") -> (Tensor, Tensor)")
    assert [(p.name, p.required, p.keyword_only) for p in s.params] == [
        ("input", True, False), ("smooth_scales", False, True), ("dims", False, True),
        ("quant_mode", False, True)]
    assert s.returns == 2
    assert parse_aten("f(Tensor(a!) self) -> Tensor(a!)").returns == 1
    assert parse_aten("f(Tensor self) -> Tensor[]").returns is None
    assert parse_aten("zeros(SymInt[] size, *, ScalarType? dtype=None) -> Tensor"
                      ).refuses(3, ["dtype"]) is None  # (torch.zeros(2, 3, 4, dtype=...))
    [atb] = parse_atb("TORCH_NPU_API std::tuple<at::Tensor, at::Tensor> g(const at::Tensor"
                      "&x, c10::optional<c10::string_view> mode, int64_t k);")
    assert [p.name for p in atb.params] == ["x", "mode", "k"] and atb.returns == 2


def test_each_op_the_standin_computes_names_vllm_ascend_s_call():
    """Where vLLM-Ascend calls an op otherwise than pdmesh, the stand-in says so (and
    where the documentation left it guessing, what it guessed)."""
    from tests.shared.kernels.npu_standin import GUESSED, OPS, VLLM_ASCEND

    assert set(VLLM_ASCEND) == set(OPS) == NPU_OPS
    assert set(GUESSED) <= set(OPS)
