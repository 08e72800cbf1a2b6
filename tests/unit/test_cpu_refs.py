"""The CPU path's torch references equal the plain formulas they stand for, bit for bit.

The references are written with fewer (fused or in-place) torch ops than the formulas, because
on CPU each op's dispatch is a visible share of a decode step; the HF parity tests need them to
round exactly where the formulas (HF transformers' own ops) round.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanopaged.kernels.rms_norm import rms_norm_ref
from nanopaged.kernels.rotary import rotary_ref
from nanopaged.kernels.silu_and_mul import silu_and_mul_ref
from nanopaged.layers.rotary import RotaryEmbedding

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rand(*shape, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def plain_rms_norm(x, weight, eps):
    """HF's LlamaRMSNorm: fp32 norm, rounded to x's dtype, times the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def plain_rotary(x, cos, sin, positions):
    """x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1], tables cast to x."""
    c = cos[positions].unsqueeze(1).to(x.dtype)
    s = sin[positions].unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat([-x2, x1], dim=-1) * s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_rms_norm_ref_is_the_plain_norm(dtype, rows):
    x = rand(rows, 576, dtype=dtype, seed=rows)
    residual = rand(rows, 576, dtype=dtype, seed=rows + 1)
    weight = rand(576, dtype=dtype, seed=2, scale=1.0)
    assert torch.equal(rms_norm_ref(x, weight, 1e-5), plain_rms_norm(x, weight, 1e-5))
    out, summed = rms_norm_ref(x, weight, 1e-5, residual)
    assert torch.equal(summed, x + residual)
    assert torch.equal(out, plain_rms_norm(x + residual, weight, 1e-5))
    # a strided x (a slice of a wider row) and an fp32 weight with a 16-bit x
    wide = rand(rows, 1000, dtype=dtype, seed=3)[:, 100:676]
    w32 = weight.float()
    assert torch.equal(rms_norm_ref(wide, w32, 1e-6), plain_rms_norm(wide, w32, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_ref_is_the_plain_rotation(dtype):
    rope = RotaryEmbedding(64, 4096, 100000.0)
    positions = torch.randperm(4096, generator=torch.Generator().manual_seed(0))[:40]
    qkv = rand(40, 15 * 64, dtype=dtype, seed=4)
    q, k = qkv[:, : 9 * 64].view(40, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(40, 3, 64)
    q_ref = plain_rotary(q, rope.cos, rope.sin, positions)
    k_ref = plain_rotary(k, rope.cos, rope.sin, positions)
    q_out, k_out = rotary_ref(q, k, rope.cos, rope.sin, positions)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    # the CPU layer: q and k of one qkv row rotate as one view; separate tensors are joined
    before = qkv.clone()
    for args in ((q, k), (q.contiguous(), k.contiguous()), (q, k[:, :2])):
        q_out, k_out = rope(positions, *args)
        assert torch.equal(q_out, q_ref)
        assert torch.equal(k_out, plain_rotary(args[1], rope.cos, rope.sin, positions))
    assert torch.equal(qkv, before), "the inputs stay as they were"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1536, 64])
def test_silu_and_mul_ref_rounds_as_hf_mlps(dtype, d):
    # silu in fp32 rounded to the dtype, then the fp32 product rounded: HF's (and vLLM's) MLP.
    for rows in (1, 16, 300):
        x = rand(rows, 2 * d, dtype=dtype, seed=rows)
        gate, up = x.float().chunk(2, dim=-1)
        want = (F.silu(gate).to(dtype).float() * up).to(dtype)
        assert torch.equal(silu_and_mul_ref(x), want)
