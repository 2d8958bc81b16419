"""Float32 projections through oneDNN's packed weights (shared/kernels/onednn_linear.py):
the products torch's mm gives, a weight reordered once, again after an in-place change,
dropped with its weight, and mm kept where oneDNN does not pay or is turned off."""

from __future__ import annotations

import gc

import pytest
import torch

from pdmesh.shared.kernels import onednn_linear
from pdmesh.shared.kernels.cpu import CPUBackend

pytestmark = pytest.mark.skipif(not onednn_linear.available(),
                                reason="this torch has no oneDNN packed linear")


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("m,k,n", [(2, 16, 16), (3, 40, 24), (64, 256, 384),
                                   (17, 768, 256), (300, 100, 1000), (5, 256, 4096)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_match_mm(m: int, k: int, n: int, with_bias: bool) -> None:
    be = CPUBackend(torch.device("cpu"))
    x, w = rand(m, k, seed=m), rand(k, n, seed=k + n)
    bias = rand(n, seed=n) if with_bias else None
    want = x @ w if bias is None else torch.addmm(bias, x, w)
    got = be.linear(x, w, bias)
    assert len(be._onednn) == 1  # (it went through oneDNN)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * k ** 0.5)


@pytest.mark.parametrize("m", [1, 2, 33])
def test_bfloat16_products_match_mm(m: int) -> None:
    be = CPUBackend(torch.device("cpu"))
    x, w = rand(m, 256, seed=m).bfloat16(), rand(256, 96, seed=3).bfloat16()
    bias = rand(96, seed=4).bfloat16()
    got = be.linear(x, w, bias)
    # (packed where this cpu's oneDNN takes bfloat16: avx_ne_convert or avx512bw/vl/dq)
    assert len(be._onednn) == int(onednn_linear.bfloat16_available())
    assert got.dtype == torch.bfloat16
    want = x.float() @ w.float() + bias.float()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=0.1)


def test_a_weight_is_reordered_once_and_again_when_it_changes() -> None:
    lin = onednn_linear.OneDNNLinears()
    x, w = rand(8, 64, seed=1), rand(64, 32, seed=2)
    first = lin._of(w)
    torch.testing.assert_close(lin.linear(x, w, None), x @ w, rtol=1e-4, atol=1e-3)
    assert lin._of(w) is first and len(lin) == 1
    w.mul_(-2.0)  # in place: the packed copy is stale
    torch.testing.assert_close(lin.linear(x, w, None), x @ w, rtol=1e-4, atol=1e-3)
    assert lin._of(w) is not first and len(lin) == 1


def test_a_packed_copy_goes_with_its_weight() -> None:
    lin = onednn_linear.OneDNNLinears()
    x = rand(4, 32, seed=3)
    keep = rand(32, 16, seed=4)
    lin.linear(x, keep, None)
    for s in range(5):  # weights that live for one call only
        lin.linear(x, rand(32, 16, seed=10 + s), None)
    gc.collect()
    assert len(lin) == 1
    torch.testing.assert_close(lin.linear(x, keep, None), x @ keep, rtol=1e-4, atol=1e-3)


def test_one_row_other_dtypes_and_views_of_other_shapes_keep_mm() -> None:
    lin = onednn_linear.OneDNNLinears()
    w = rand(32, 16, seed=5)
    assert lin.usable(rand(2, 32, seed=6), w)
    assert not lin.usable(rand(1, 32, seed=6), w)  # one row: BLAS's GEMV
    # bf16: from one row, where this cpu's oneDNN takes bfloat16
    assert lin.usable(rand(1, 32, seed=6).bfloat16(), w.bfloat16()) \
        == onednn_linear.bfloat16_available()
    assert not lin.usable(rand(4, 32, seed=6).bfloat16(), w)  # (dtypes differ)
    assert not lin.usable(rand(4, 32, seed=6).half(), w.half())
    assert not lin.usable(rand(4, 32, seed=6), rand(3, 32, 16, seed=7))
    be = CPUBackend(torch.device("cpu"))
    x1 = rand(1, 32, seed=8)
    torch.testing.assert_close(be.linear(x1, w), x1 @ w)
    assert len(be._onednn) == 0


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDMESH_CPU_ONEDNN_LINEAR", "0")
    assert not onednn_linear.available()
    be = CPUBackend(torch.device("cpu"))
    assert be._onednn is None
    x, w = rand(8, 32, seed=9), rand(32, 16, seed=10)
    torch.testing.assert_close(be.linear(x, w), x @ w)


def test_a_product_asked_for_its_gradient_keeps_mm() -> None:
    be = CPUBackend(torch.device("cpu"))
    x = rand(8, 32, seed=11)
    w = rand(32, 16, seed=12).requires_grad_()
    be.linear(x, w).sum().backward()  # (the packed op has no backward)
    torch.testing.assert_close(w.grad, x.t() @ torch.ones(8, 16))
    assert len(be._onednn) == 0
    with torch.no_grad():
        torch.testing.assert_close(be.linear(x, w), x @ w, rtol=1e-4, atol=1e-3)
    assert len(be._onednn) == 1
