"""The fp32 C kernels of kernels/cpu_native.c outside attention (the norm, SiLU * up, the
one-row GEMV) against their torch references, and the op table that dispatches to them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanopaged.kernels import cpu_native
from nanopaged.kernels.rms_norm import rms_norm_ref
from nanopaged.kernels.silu_and_mul import silu_and_mul_ref
from nanopaged.layers import cpu_gemm
from nanopaged.layers.backend import CPU_NATIVE

pytestmark = pytest.mark.skipif(
    cpu_native._compiler() is None, reason="no C compiler on this machine"
)


def rand(*shape, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * scale


def _dot_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A bound on fp32 summation error for each x . w[j]: k ulps of the sum of |products|."""
    k = x.shape[-1]
    return (x.abs().double() @ weight.abs().double().T) * (k * 2.0**-24) + 1e-30


@pytest.mark.parametrize("n,k", [(1, 1), (3, 7), (5, 9), (13, 577), (960, 576), (6, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_row_matches_f_linear(n, k, with_bias):
    # Odd sizes: the four-row blocks' remainder and the 8-lane tails; the weight a view with
    # rows further apart than k (a slice of a wider matrix).
    wide = rand(n, k + 5, seed=n * k)
    weight, x = wide[:, 2 : k + 2], rand(1, k, seed=k)
    bias = rand(n, seed=n) if with_bias else None
    out = cpu_native.linear_row(x, weight, bias)
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    assert out.dtype == torch.float32 and out.shape == (1, n)
    assert ((out.double() - exact).abs() <= _dot_bound(x, weight) + 1e-6).all()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_linear_row_keeps_nan_and_inf():
    weight = rand(6, 17, seed=1)
    x = rand(1, 17, seed=2)
    x[0, 3] = float("inf")
    out, expected = cpu_native.linear_row(x, weight), F.linear(x, weight)
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.isinf(), expected.isinf())


@pytest.mark.parametrize("rows,hidden", [(1, 1), (1, 576), (3, 7), (5, 577), (2, 960)])
def test_rms_norm_f32_matches_reference(rows, hidden):
    x, residual = rand(rows, hidden, seed=hidden, scale=3), rand(rows, hidden, seed=rows)
    weight = rand(hidden, seed=7)
    out = cpu_native.rms_norm(x, weight, 1e-5)
    expected = rms_norm_ref(x, weight, 1e-5)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    # Only the sum of squares adds in another order: a few ulps.
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)
    got_out, got_res = cpu_native.rms_norm(x, weight, 1e-5, residual)
    exp_out, exp_res = rms_norm_ref(x, weight, 1e-5, residual)
    assert torch.equal(got_res, exp_res)  # the residual sum bit for bit
    torch.testing.assert_close(got_out, exp_out, rtol=1e-6, atol=1e-7)
    heads = x.view(rows, 1, hidden)  # three dimensions come back in x's shape
    assert torch.equal(cpu_native.rms_norm(heads, weight, 1e-5), out.view(rows, 1, hidden))


@pytest.mark.parametrize("rows,d", [(1, 1), (1, 1536), (3, 7), (4, 33), (2, 1537)])
def test_silu_and_mul_f32_matches_reference(rows, d):
    x = rand(rows, 2 * d, seed=d, scale=4)
    x[0, 0] = -100.0  # e^100 overflows to inf: silu -> -0
    x[0, min(1, d - 1)] = 90.0
    out, expected = cpu_native.silu_and_mul(x), silu_and_mul_ref(x)
    assert out.shape == expected.shape == (rows, d) and out.is_contiguous()
    # exp_f32 is within ~2 ulp of torch's exp; the division and product round as torch's
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-30)
    strided = x.view(rows, 1, 2 * d)
    assert torch.equal(cpu_native.silu_and_mul(strided), out.view(rows, 1, d))


def test_native_op_table_dispatches_fp32(monkeypatch):
    calls = []
    real = cpu_native.linear_row

    def spy(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(cpu_native, "linear_row", spy)
    weight, bias = rand(96, 64, seed=1), rand(96, seed=2)
    packed = cpu_gemm.pack_weight(weight)
    for rows in (1, 2, 16):
        x = rand(rows, 64, seed=rows)
        out = CPU_NATIVE.linear(x, weight, bias, packed)
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert calls == [1]  # one row through the GEMV; more through oneDNN's packed weight
    x = rand(1, 64, seed=3)
    CPU_NATIVE.linear(x.bfloat16(), weight.bfloat16(), None, None)  # bf16: never the GEMV
    assert calls == [1]
    x, residual, w = rand(2, 64, seed=4), rand(2, 64, seed=5), rand(64, seed=6)
    torch.testing.assert_close(
        CPU_NATIVE.rms_norm(x, w, 1e-6, residual), rms_norm_ref(x, w, 1e-6, residual),
        rtol=1e-6, atol=1e-7,
    )  # fmt: skip
    gate_up = rand(2, 3, 128, seed=7)
    out = CPU_NATIVE.silu_and_mul(gate_up)
    assert out.shape == (2, 3, 64)
    torch.testing.assert_close(out, silu_and_mul_ref(gate_up), rtol=1e-6, atol=1e-30)
