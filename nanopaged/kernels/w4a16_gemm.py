"""y = x W for 4-bit weights in AWQ or GPTQ packing, dequantized in registers (W4A16).

At decode the weight bytes are the step's cost; 4-bit weights are a quarter of bf16's. The
kernel reads each packed int32 once per tile, unpacks its nibbles with shifts, applies the
group's zero and scale, and feeds the tensor cores with the 16-bit result: one pass over the
packed weight, no dequantized copy in memory (the idea Marlin builds on; the layout stays the
checkpoint's, so loading never repacks).

- AWQ ("GEMM" version): qweight [K, N/8], eight output columns per int32 in the order
  0, 2, 4, 6, 1, 3, 5, 7 (column j of a pack sits at nibble (j % 2) * 4 + j // 2); qzeros
  [K/group, N/8] packed the same way; scales [K/group, N].
- GPTQ: qweight [K/8, N], eight input rows per int32, row k at nibble k % 8; qzeros
  [K/group, N/8] with column n at nibble n % 8; scales [K/group, N]; g_idx [K], the group of
  each input row (desc_act orders rows by activation size, so groups are not contiguous).
  v1 checkpoints store zero - 1 (zero_offset=1).

W[k, n] = (q[k, n] - zero[g(k), n]) * scale[g(k), n]; symmetric weights have zero 8.

Few rows (decode) give few output tiles, so K can be split: each split writes an fp32 partial
and one torch sum adds them in split order (deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanopaged.kernels.paged_decode import dot_precision, num_sms

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs dequantize at load (dequantize_int4)
    triton = None

LAYOUTS = ("awq", "gptq")
PACK = 8  # 4-bit values per int32


@dataclass
class Int4Weight:
    """A 4-bit weight of in_features x out_features, packed as its checkpoint stores it."""

    layout: str  # "awq" or "gptq", see the module docstring
    qweight: torch.Tensor  # int32
    scales: torch.Tensor  # [groups, out_features]
    qzeros: torch.Tensor | None  # int32 [groups, out_features / 8]; None: symmetric (zero 8)
    group_size: int
    g_idx: torch.Tensor | None = None  # int32 [in_features] (GPTQ); None: row k in k // group
    zero_offset: int = 0  # added to each stored zero (GPTQ v1 checkpoints store zero - 1)

    @property
    def in_features(self) -> int:
        rows = self.qweight.shape[0]
        return rows if self.layout == "awq" else rows * PACK

    @property
    def out_features(self) -> int:
        return self.scales.shape[1]


def _nibbles(packed: torch.Tensor, dim: int, order: tuple[int, ...]) -> torch.Tensor:
    """int32 values of 4-bit fields: packed [..] -> 8x longer along dim; value j of each int32
    comes from nibble order[j]."""
    shifts = torch.tensor(order, dtype=torch.int32, device=packed.device) * 4
    # fields: packed with a new axis of 8 after dim, each the nibble at its shift
    fields = packed.unsqueeze(dim + 1) >> shifts.view([-1] + [1] * (packed.dim() - dim - 1))
    fields = fields & 0xF
    shape = list(packed.shape)
    shape[dim] *= PACK
    return fields.reshape(shape)


AWQ_ORDER = tuple((j % 2) * 4 + j // 2 for j in range(PACK))  # nibble of column j in a pack
SEQUENTIAL = tuple(range(PACK))


def unpack_int4(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [K, N], zeros [groups, N]) as int32, zeros with zero_offset applied."""
    if w.layout == "awq":
        q = _nibbles(w.qweight, 1, AWQ_ORDER)
    else:
        q = _nibbles(w.qweight, 0, SEQUENTIAL)
    if w.qzeros is None:
        zeros = torch.full(w.scales.shape, 8, dtype=torch.int32, device=q.device)
    else:
        zeros = _nibbles(w.qzeros, 1, AWQ_ORDER if w.layout == "awq" else SEQUENTIAL)
        zeros = zeros + w.zero_offset
    return q, zeros


def group_index(w: Int4Weight) -> torch.Tensor:
    """int64 [K]: the scale/zero row of each input row."""
    if w.g_idx is not None:
        return w.g_idx.long()
    return torch.arange(w.in_features, device=w.qweight.device) // w.group_size


def dequantize_int4(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as [K, N] floats of dtype: (q - zero) * scale computed in fp32."""
    q, zeros = unpack_int4(w)
    g = group_index(w)
    return ((q - zeros[g]).float() * w.scales[g].float()).to(dtype)


def w4a16_gemm_ref(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """Torch reference: x [M, K] @ the dequantized weight, in x's dtype."""
    return F.linear(x, dequantize_int4(w, x.dtype).t())


@dataclass(frozen=True)
class W4A16Config:
    """Launch parameters; block_k must divide the group size (one scale row per tile) unless
    the weight carries g_idx."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def default_config(m: int, n: int, k: int, group_size: int, num_sms: int = 132) -> W4A16Config:
    """A launch for x [m, k] and an [k, n] weight: small m splits K until about two programs
    per SM (decode); large m takes wide tiles for the tensor cores. Untuned guesses to be
    checked with benchmarks/quant_gemm_bench.py."""
    block_k = max(16, min(128 if m <= 16 else 64, group_size, k))
    if m <= 16:
        block_m, block_n, warps = 16, 64, 4
    elif m <= 64:
        block_m, block_n, warps = 32, 128, 4
    else:
        block_m, block_n, warps = 64 if m <= 128 else 128, 128, 8
    tiles = -(-m // block_m) * -(-n // block_n)
    split = 1
    while tiles * split * 2 <= 2 * num_sms and k // (block_k * split * 2) >= 2:
        split *= 2
    return W4A16Config(block_m, block_n, block_k, split, warps)


if triton is not None:

    @triton.jit
    def _w4a16_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr,
        M, N, K, k_per_split, group_size, zero_offset,
        stride_xm, stride_qw, stride_s, stride_z, stride_os, stride_om,
        AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        split = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        # Nibble of each output column in its int32: AWQ's interleaved order, or in sequence.
        if AWQ:
            col_shift = ((offs_n % 8) % 2 * 4 + (offs_n % 8) // 2) * 4
        else:
            col_shift = (offs_n % 8) * 4
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = split * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :], other=0.0,
            )  # fmt: skip
            mask_w = mask_k[:, None] & mask_n[None, :]
            # q: [BLOCK_K, BLOCK_N] 4-bit values
            if AWQ:
                packed = tl.load(qw_ptr + offs_k[:, None] * stride_qw + offs_n[None, :] // 8,
                                 mask=mask_w, other=0)  # fmt: skip
                q = (packed >> col_shift[None, :]) & 0xF
            else:
                packed = tl.load(qw_ptr + (offs_k[:, None] // 8) * stride_qw + offs_n[None, :],
                                 mask=mask_w, other=0)  # fmt: skip
                q = (packed >> ((offs_k % 8) * 4)[:, None]) & 0xF
            if HAS_G_IDX:
                # rows of one tile may sit in any group: gather a scale (and zero) per row
                g = tl.load(g_ptr + offs_k, mask=mask_k, other=0)
                scale = tl.load(s_ptr + g[:, None] * stride_s + offs_n[None, :], mask=mask_w,
                                other=0.0).to(tl.float32)  # fmt: skip
                if HAS_ZEROS:
                    zp = tl.load(z_ptr + g[:, None] * stride_z + offs_n[None, :] // 8,
                                 mask=mask_w, other=0)  # fmt: skip
                    zero = ((zp >> col_shift[None, :]) & 0xF) + zero_offset
                else:
                    zero = 8
            else:
                # block_k divides the group size: the whole tile is one group
                g = k0 // group_size
                scale = tl.load(s_ptr + g * stride_s + offs_n, mask=mask_n, other=0.0)
                scale = scale.to(tl.float32)[None, :]
                if HAS_ZEROS:
                    zp = tl.load(z_ptr + g * stride_z + offs_n // 8, mask=mask_n, other=0)
                    zero = (((zp >> col_shift) & 0xF) + zero_offset)[None, :]
                else:
                    zero = 8
            w = ((q - zero).to(tl.float32) * scale).to(x.dtype)
            acc += tl.dot(x, w, input_precision=DOT_PRECISION)
        out = out_ptr + split * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _check(x: torch.Tensor, w: Int4Weight, config: W4A16Config) -> None:
    k, n = w.in_features, w.out_features
    assert w.layout in LAYOUTS, w.layout
    assert x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1, (x.shape, k)
    assert w.qweight.dtype == torch.int32 and w.qweight.is_contiguous()
    assert w.scales.is_contiguous() and w.scales.shape == (w.scales.shape[0], n)
    assert n % PACK == 0 and k % PACK == 0, (k, n)
    expect = (k, n // PACK) if w.layout == "awq" else (k // PACK, n)
    assert tuple(w.qweight.shape) == expect, (tuple(w.qweight.shape), expect)
    if w.qzeros is not None:
        assert w.qzeros.dtype == torch.int32 and w.qzeros.is_contiguous()
        assert tuple(w.qzeros.shape) == (w.scales.shape[0], n // PACK)
    if w.g_idx is None:
        assert w.group_size % config.block_k == 0, (w.group_size, config.block_k)
    else:
        assert w.g_idx.dtype == torch.int32 and tuple(w.g_idx.shape) == (k,)
    assert config.block_k % PACK == 0 and config.block_k >= 16


def w4a16_gemm(x: torch.Tensor, w: Int4Weight, config: W4A16Config | None = None) -> torch.Tensor:
    """x [M, K] (16-bit; fp32 too, as the interpreter runs) @ w -> [M, N] in x's dtype."""
    m = x.shape[0]
    k, n = w.in_features, w.out_features
    if config is None:
        config = default_config(m, n, k, w.group_size, num_sms(x.device))
    _check(x, w, config)
    k_per_split = -(-k // (config.split_k * config.block_k)) * config.block_k
    splits = -(-k // k_per_split)
    if splits == 1:
        out = torch.empty(1, m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    if m == 0:
        return out[0]
    zeros = w.qzeros if w.qzeros is not None else w.qweight  # unread without zeros
    g_idx = w.g_idx if w.g_idx is not None else w.qweight  # unread without g_idx
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), splits)
    _w4a16_kernel[grid](
        x, w.qweight, w.scales, zeros, g_idx, out,
        m, n, k, k_per_split, w.group_size, w.zero_offset,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), zeros.stride(0),
        out.stride(0), out.stride(1),
        AWQ=w.layout == "awq", HAS_ZEROS=w.qzeros is not None, HAS_G_IDX=w.g_idx is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        DOT_PRECISION=dot_precision(x.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out[0] if splits == 1 else out.sum(0).to(x.dtype)
