"""W8A8 FP8 GEMMs: activations quantized per token (or per token and 128-wide group) on the
fly, weights e4m3 with block or per-channel scales.

- per_token_group_quant: x [M, K] -> e4m3 [M, K] and fp32 scales [M, K / group], each group's
  largest |x| mapped to e4m3's 448 (group = K: one scale per token).
- w8a8_block_gemm: e4m3 x with its group scales @ an e4m3 weight [N, K] whose scale covers a
  [block_n, block_k] tile (block_k = the activations' group): each K step's fp8 product is
  scaled by the row's and the tile's scale and summed in fp32. A per-channel weight is the
  block (1, K). Few rows give few tiles, so K can be split (fp32 partials, one torch sum).

Per-channel weights with many rows go to torch._scaled_mm (cuBLAS / CUTLASS row-wise scaling)
instead; see nanopaged/quantization/fp8.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanopaged.kernels.paged_decode import num_sms

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs dequantize at load (dequantize_fp8)
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# A group of zeros gets this scale, not 0 (x / 0 is NaN).
MIN_SCALE = 1e-10


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """weight e4m3 [N, K] times its scale per [block_n, block_k] tile (scale
    [ceil(N / block_n), ceil(K / block_k)], fp32 arithmetic) as dtype."""
    n, k = weight.shape
    rows = torch.arange(n, device=weight.device) // block[0]
    cols = torch.arange(k, device=weight.device) // block[1]
    return (weight.float() * scale.float()[rows][:, cols]).to(dtype)


def per_token_group_quant_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: (e4m3 [M, K], fp32 scales [M, K / group]) of x [M, K]."""
    m, k = x.shape
    groups = x.float().view(m, k // group, group)
    scale = (groups.abs().amax(-1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, k), scale


def w8a8_block_gemm_ref(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Torch reference: both operands dequantized, multiplied in fp32, rounded once."""
    x = dequantize_fp8(xq, x_scale, (1, xq.shape[1] // x_scale.shape[1]), torch.float32)
    return (x @ dequantize_fp8(weight, w_scale, block, torch.float32).t()).to(out_dtype)


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Launch parameters; block_k must divide the weight's block_k (one scale per K step)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def default_config(m: int, n: int, k: int, group_k: int, num_sms: int = 132) -> Fp8GemmConfig:
    """Untuned guesses (benchmarks/quant_gemm_bench.py measures them): decode sizes split K
    until about two programs per SM, larger m takes wide tiles."""
    block_k = min(128, group_k)
    while group_k % block_k:
        block_k //= 2
    block_m, block_n, warps = (16, 64, 4) if m <= 16 else (64, 128, 4) if m <= 64 else (
        128, 128, 8)  # fmt: skip
    tiles = -(-m // block_m) * -(-n // block_n)
    split = 1
    while tiles * split * 2 <= 2 * num_sms and k // (block_k * split * 2) >= 2:
        split *= 2
    return Fp8GemmConfig(block_m, block_n, max(block_k, 16), split, warps)


if triton is not None:

    @triton.jit
    def _quant_kernel(
        x_ptr, q_ptr, s_ptr, K, group, stride_xm, stride_qm, stride_sm,
        FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        g = tl.program_id(1)
        offs = g * group + tl.arange(0, BLOCK)
        mask = (tl.arange(0, BLOCK) < group) & (offs < K)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX_C, MIN_SCALE_C)
        q = tl.clamp(x / scale, -FP8_MAX_C, FP8_MAX_C)
        tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * stride_sm + g, scale)

    @triton.jit
    def _w8a8_block_kernel(
        a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, M, N, K, k_per_split,
        stride_am, stride_asm, stride_bn, stride_bsn, stride_os, stride_om,
        GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        split = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = split * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
            # b: [BLOCK_K, BLOCK_N], the weight [N, K] read transposed
            b = tl.load(b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None],
                        mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # fmt: skip
            kb = k0 // GROUP_K
            a_s = tl.load(as_ptr + offs_m * stride_asm + kb, mask=mask_m, other=0.0)
            b_s = tl.load(bs_ptr + (offs_n // GROUP_N) * stride_bsn + kb, mask=mask_n, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        out = out_ptr + split * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def per_token_group_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], fp32 scales [M, K / group]) of x [M, K] in one launch."""
    m, k = x.shape
    assert k % group == 0 and x.stride(1) == 1, (x.shape, group)
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, k // group, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(group)
        _quant_kernel[(m, k // group)](
            x, q, scale, k, group, x.stride(0), q.stride(0), scale.stride(0),
            FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE, BLOCK=block,
            num_warps=max(1, min(16, block // 256)),
        )  # fmt: skip
    return q, scale


def w8a8_block_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """xq e4m3 [M, K] with x_scale [M, K / block_k] @ weight e4m3 [N, K] with w_scale
    [ceil(N / block_n), ceil(K / block_k)] -> [M, N] of out_dtype."""
    m, k = xq.shape
    n = weight.shape[0]
    bn, bk = block
    if config is None:
        config = default_config(m, n, k, bk, num_sms(xq.device))
    assert xq.dtype == weight.dtype == FP8 and weight.shape[1] == k, (xq.shape, weight.shape)
    assert xq.stride(1) == 1 and weight.stride(1) == 1 and w_scale.stride(1) == 1
    assert x_scale.shape == (m, -(-k // bk)) and x_scale.stride(1) == 1, (x_scale.shape, k, bk)
    assert w_scale.shape == (-(-n // bn), -(-k // bk)), (w_scale.shape, n, k, block)
    assert bk % config.block_k == 0, (bk, config.block_k)
    k_per_split = -(-k // (config.split_k * config.block_k)) * config.block_k
    splits = -(-k // k_per_split)
    out = torch.empty(splits, m, n, dtype=out_dtype if splits == 1 else torch.float32,
                      device=xq.device)  # fmt: skip
    if m == 0:
        return out[0]
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), splits)
    _w8a8_block_kernel[grid](
        xq, x_scale, weight, w_scale, out, m, n, k, k_per_split,
        xq.stride(0), x_scale.stride(0), weight.stride(0), w_scale.stride(0),
        out.stride(0), out.stride(1),
        GROUP_N=bn, GROUP_K=bk,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out[0] if splits == 1 else out.sum(0).to(out_dtype)
