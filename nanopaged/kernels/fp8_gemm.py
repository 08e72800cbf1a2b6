"""W8A8 FP8 GEMMs: activations quantized per token (or per token and 128-wide group) on the
fly, weights e4m3 with block or per-channel scales.

- per_token_group_quant: x [M, K] -> e4m3 [M, K] and fp32 scales [M, K / group], each group's
  largest |x| mapped to e4m3's 448 (group = K: one scale per token).
- w8a8_block_gemm: e4m3 x with its group scales @ an e4m3 weight [N, K] whose scale covers a
  [block_n, block_k] tile (block_k = the activations' group): each K step's fp8 product is
  scaled by the row's and the tile's scale and summed in fp32. A per-channel weight is the
  block (1, K). Few rows give few tiles, so K can be split (fp32 partials, one summing kernel).
- block_scaled_mm: torch's scaled matmul with 1x128 activation and 128x128 weight block
  scales, where this torch and GPU run it (block_scaled_mm_available probes once).

With many rows, per-channel weights go to torch._scaled_mm (row-wise scaling) and 128x128
block weights to block_scaled_mm where available; see nanopaged/quantization/fp8.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanopaged.kernels.paged_decode import num_sms
from nanopaged.kernels.w4a16_gemm import auto_split, sum_splits
from nanopaged.platform import platform_of

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


# Tiles by row count: the first entry whose max rows >= m (split_k 0: split K until about one
# wave of programs). Edit from `benchmarks/quant_gemm_bench.py --tune`.
DEFAULT_TILES: tuple[tuple[int, Fp8GemmConfig], ...] = (
    (16, Fp8GemmConfig(16, 64, 128, split_k=0, num_warps=4, num_stages=4)),
    (64, Fp8GemmConfig(64, 128, 128, split_k=0, num_warps=4, num_stages=4)),
    (128, Fp8GemmConfig(64, 128, 128, split_k=1, num_warps=4, num_stages=4)),
    (1 << 62, Fp8GemmConfig(128, 128, 128, split_k=1, num_warps=8, num_stages=3)),
)
# Launches measured best for one (max rows of its tile entry, n, k); override DEFAULT_TILES.
TUNED: dict[tuple[int, int, int], Fp8GemmConfig] = {}


def default_config(m: int, n: int, k: int, group_k: int, num_sms: int = 132) -> Fp8GemmConfig:
    """TUNED for this shape if measured, else the DEFAULT_TILES entry of this row count;
    block_k shrinks to divide the weight's block_k (one scale per K step)."""
    bucket, tile = next((rows, c) for rows, c in DEFAULT_TILES if m <= rows)
    config = TUNED.get((bucket, n, k), tile)
    block_k = min(config.block_k, group_k)
    while group_k % block_k:
        block_k //= 2
    block_k = max(block_k, 16)
    split = config.split_k
    if split == 0:
        tiles = -(-m // config.block_m) * -(-n // config.block_n)
        split = auto_split(tiles, k, block_k, num_sms)
    return Fp8GemmConfig(config.block_m, config.block_n, block_k, split, config.num_warps,
                         config.num_stages)  # fmt: skip


if triton is not None:

    @triton.jit
    def _quant_kernel(
        x_ptr, q_ptr, s_ptr, K, group, stride_xm, stride_qm, stride_sm, stride_sg,
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
        tl.store(s_ptr + row * stride_sm + g * stride_sg, scale)

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


def per_token_group_quant(
    x: torch.Tensor, group: int, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], fp32 scales [M, K / group]) of x [M, K] in one launch; column-major
    scales (stride (1, M)) are the layout torch's block-scaled matmul reads."""
    m, k = x.shape
    assert k % group == 0 and x.stride(1) == 1, (x.shape, group)
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    if column_major_scales:
        scale = torch.empty(k // group, m, dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty(m, k // group, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(group)
        _quant_kernel[(m, k // group)](
            x, q, scale, k, group, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
            FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE, BLOCK=block,
            num_warps=max(1, min(16, block // 256)),
        )  # fmt: skip
    return q, scale


# torch's block-scaled matmul (cuBLAS on Hopper, CUDA >= 12.9) takes exactly 128-wide blocks.
SCALED_MM_BLOCK = (128, 128)
_block_scaled_mm_ok: dict[torch.device, bool] = {}


def block_scaled_mm_weight_scale(w_scale: torch.Tensor) -> torch.Tensor:
    """A weight's [N / 128, K / 128] block scales as cuBLAS's block-scaled matmul reads them:
    [K / 128 padded to a multiple of 4, N / 128], K blocks contiguous (the shape torch checks
    on an H100; the padding scales no column of the weight)."""
    nb, kb = w_scale.shape
    padded = torch.ones(nb, -(-kb // 4) * 4, dtype=torch.float32, device=w_scale.device)
    padded[:, :kb] = w_scale
    return padded.t()


def block_scaled_mm(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale_t: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """xq e4m3 [M, K] with column-major x_scale [M, K / 128] @ weight e4m3 [N, K] with
    w_scale_t from block_scaled_mm_weight_scale, through torch's scaled matmul (1x128 by
    128x128 block scaling). cuBLAS takes a row count that is a multiple of 4: others run
    with zero rows added (on an H100, 17 rows were refused, 300 ran)."""
    m, k = xq.shape
    pad = -m % 4
    if pad:
        zeros = torch.zeros(pad, k, dtype=torch.uint8, device=xq.device)  # e4m3 bits of +0
        xq = torch.cat([xq.view(torch.uint8), zeros]).view(xq.dtype)
        x_scale = torch.cat([x_scale, x_scale.new_ones(pad, x_scale.shape[1])])
        x_scale = x_scale.t().contiguous().t()
    st = torch.nn.functional.ScalingType
    out = torch.nn.functional.scaled_mm(
        xq, weight.t(), x_scale, st.BlockWise1x128, w_scale_t, st.BlockWise128x128,
        output_dtype=out_dtype,
    )  # fmt: skip
    return out[:m] if pad else out


def block_scaled_mm_available(device: torch.device) -> bool:
    """Whether this torch and GPU run block_scaled_mm: one probe per device, on tiny inputs,
    compared with w8a8_block_gemm_ref (an unsupported build raises or computes otherwise)."""
    device = torch.device(device)
    if device in _block_scaled_mm_ok:
        return _block_scaled_mm_ok[device]
    ok = False
    if platform_of(device).gpu and hasattr(torch.nn.functional, "ScalingType"):
        gen = torch.Generator().manual_seed(0)
        # 18 rows and 3 K blocks: both paddings (rows to 4, K blocks to 4) take part
        x = torch.randn(18, 384, generator=gen).to(device, torch.bfloat16)
        w = torch.randn(256, 384, generator=gen).mul(50).clamp(-FP8_MAX, FP8_MAX).to(device, FP8)
        w_scale = (torch.rand(2, 3, generator=gen) * 1e-2 + 1e-3).to(device)
        xq, x_scale = per_token_group_quant(x, 128, column_major_scales=True)
        ref = w8a8_block_gemm_ref(xq, x_scale, w, w_scale, SCALED_MM_BLOCK, torch.float32)
        try:
            out = block_scaled_mm(xq, x_scale, w, block_scaled_mm_weight_scale(w_scale),
                                  torch.bfloat16)  # fmt: skip
            ok = bool(((out.float() - ref).abs().max() / ref.abs().max()).item() <= 1e-2)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            ok = False  # a build without block-wise scaling for this GPU
    _block_scaled_mm_ok[device] = ok
    return ok


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
    return out[0] if splits == 1 else sum_splits(out, out_dtype)
