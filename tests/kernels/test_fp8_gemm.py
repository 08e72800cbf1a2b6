"""The W8A8 FP8 kernels against their torch references: per-token (group) activation
quantization and the block-scaled GEMM (block tiles, per-channel (1, K), K splits, ragged
tiles); dequantize_fp8 against the test's own block quantizer."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import DEVICE
from quant_formats import quantize_fp8_block, quantize_fp8_scaled

from nanopaged.kernels.fp8_gemm import (
    FP8,
    FP8_MAX,
    MIN_SCALE,
    SCALED_MM_BLOCK,
    Fp8GemmConfig,
    block_scaled_mm,
    block_scaled_mm_available,
    block_scaled_mm_weight_scale,
    default_config,
    dequantize_fp8,
    per_token_group_quant,
    per_token_group_quant_ref,
    w8a8_block_gemm,
    w8a8_block_gemm_ref,
)


def test_dequantize_matches_the_quantizer():
    w = torch.randn(80, 96)
    tensors, deq = quantize_fp8_block(w, (32, 64))  # ragged blocks in both dims
    got = dequantize_fp8(tensors["weight"], tensors["weight_scale_inv"], (32, 64), torch.float32)
    assert torch.equal(got, deq)
    tensors, deq = quantize_fp8_scaled(w, "channel")
    got = dequantize_fp8(tensors["weight"], tensors["weight_scale"], (1, 96), torch.float32)
    assert torch.equal(got, deq)


def test_quant_ref_bounds():
    x = torch.randn(6, 256) * torch.logspace(-3, 3, 6)[:, None]
    x[2] = 0  # a row of zeros: a tiny scale, not a division by zero
    q, scale = per_token_group_quant_ref(x, 128)
    assert scale.shape == (6, 2) and q.dtype == FP8
    assert scale[2].eq(MIN_SCALE).all() and q[2].float().eq(0).all()
    back = q.float().view(6, 2, 128) * scale[..., None]
    # e4m3 keeps 3 mantissa bits: within 1/16 of each value, or of the group's tiniest step
    err = (back - x.view(6, 2, 128)).abs()
    assert (err <= x.view(6, 2, 128).abs() / 16 + scale[..., None] * 2**-9).all()
    assert q.float().abs().amax(-1).eq(FP8_MAX).view(6)[[0, 1, 3, 4, 5]].all()


@pytest.mark.parametrize("group", [64, 256])
def test_quant_kernel_matches_reference(group):
    # Values whose scaled form e4m3 holds exactly (fp8 values times a power of two, each group
    # holding +-448 times it): the interpreter's fp32 -> fp8 cast rounds some others wrongly.
    gen = torch.Generator().manual_seed(0)
    grid = torch.randn(5, 256, generator=gen).mul(100).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
    grid.view(5, -1, group)[:, :, 0] = FP8_MAX
    x = (grid * torch.tensor([2.0, 0.25, 1.0, 8.0, 2**-6])[:, None]).to(DEVICE)
    q, scale = per_token_group_quant(x, group)
    q_ref, scale_ref = per_token_group_quant_ref(x, group)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float())


def test_quant_kernel_column_major_scales():
    """The scales torch's block-scaled matmul reads: the same values, stride (1, M)."""
    x = torch.randn(7, 384, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    q, scale = per_token_group_quant(x, 128)
    q_t, scale_t = per_token_group_quant(x, 128, column_major_scales=True)
    assert scale_t.shape == (7, 3) and scale_t.stride() == (1, 7)
    assert torch.equal(scale_t, scale) and torch.equal(q_t.float(), q.float())


def test_block_scaled_mm_weight_scale_layout():
    w_scale = torch.rand(6, 3)
    t = block_scaled_mm_weight_scale(w_scale)
    assert t.shape == (4, 6) and t.stride() == (1, 4) and torch.equal(t[:3], w_scale.t())


def test_block_scaled_mm_probe():
    """Only a CUDA build that computes it right takes the block-scaled matmul."""
    assert not block_scaled_mm_available(torch.device("cpu"))


@pytest.mark.parametrize("m", [1, 3, 16, 33, 256])
@pytest.mark.parametrize("block", [(128, 128), (1, 384)], ids=str)
def test_block_gemm_default_config(m, block):
    """The launcher's own tiles at each row count (K = 384: three 128-wide steps)."""
    xq, x_scale, w, w_scale = _operands(m, 72, 384, block, seed=m)
    config = default_config(m, 72, 384, block[1], num_sms=8)
    assert block[1] % config.block_k == 0
    out = w8a8_block_gemm(xq, x_scale, w, w_scale, block, torch.float32, config)
    ref = w8a8_block_gemm_ref(xq, x_scale, w, w_scale, block, torch.float32)
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5


def _operands(m: int, n: int, k: int, block: tuple[int, int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    xq, x_scale = per_token_group_quant_ref(x, block[1])
    w = torch.randn(n, k, generator=gen).mul(50).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    w_scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) * 1e-2 + 1e-3
    return [t.to(DEVICE) for t in (xq, x_scale, w, w_scale)]


@pytest.mark.parametrize("block", [(32, 64), (128, 128), (1, 256)], ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "m, config",
    [
        (1, Fp8GemmConfig(16, 32, 32)),
        (5, Fp8GemmConfig(16, 64, 64, split_k=2)),
        (17, Fp8GemmConfig(16, 32, 32, split_k=3)),
        (33, Fp8GemmConfig(32, 64, 64)),
        (3, None),
    ],
)
def test_block_gemm_matches_reference(block, out_dtype, m, config):
    xq, x_scale, w, w_scale = _operands(m, 80, 256, block, seed=m)
    out = w8a8_block_gemm(xq, x_scale, w, w_scale, block, out_dtype, config)
    ref = w8a8_block_gemm_ref(xq, x_scale, w, w_scale, block, out_dtype)
    tol = 1e-5 if out_dtype == torch.float32 else 2e-3
    assert out.dtype == out_dtype and out.shape == (m, 80)
    assert ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item() <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(128, 128), (1, 4096)], ids=str)
@pytest.mark.parametrize("m", [1, 16, 256])
def test_block_gemm_gpu(block, m):
    xq, x_scale, w, w_scale = _operands(m, 6144, 4096, block)
    out = w8a8_block_gemm(xq, x_scale, w, w_scale, block, torch.bfloat16)
    ref = w8a8_block_gemm_ref(xq, x_scale, w, w_scale, block, torch.float32)
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 256])
def test_block_scaled_mm_gpu(m):
    """Where the probe says the build runs it, torch's block-scaled matmul matches the
    reference on a Qwen3 shape; where it says not, the call fails or computes otherwise."""
    xq, x_scale, w, w_scale = _operands(m, 6144, 4096, SCALED_MM_BLOCK)
    x_scale_t = x_scale.t().contiguous().t()
    ref = w8a8_block_gemm_ref(xq, x_scale, w, w_scale, SCALED_MM_BLOCK, torch.float32)
    try:
        out = block_scaled_mm(xq, x_scale_t, w, block_scaled_mm_weight_scale(w_scale),
                              torch.bfloat16)  # fmt: skip
        right = ((out.float() - ref).abs().max() / ref.abs().max()).item() <= 1e-2
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        right = False
    assert right == block_scaled_mm_available(torch.device(DEVICE))


@pytest.mark.gpu
def test_quant_kernel_gpu_rounds_like_torch():
    x = torch.randn(64, 4096, device=DEVICE, dtype=torch.bfloat16) * 3
    for group in (128, 4096):
        q, scale = per_token_group_quant(x, group)
        q_ref, scale_ref = per_token_group_quant_ref(x, group)
        assert torch.equal(scale, scale_ref)
        assert (q.float() - q_ref.float()).abs().le(q_ref.float().abs() / 8 + 1e-6).all()
