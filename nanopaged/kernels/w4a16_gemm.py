"""y = x W for 4-bit weights in AWQ or GPTQ packing, dequantized in registers (W4A16).

At decode the weight bytes are the step's cost; 4-bit weights are a quarter of bf16's. The
kernel loads each packed int32 once per tile (a [BLOCK_K, BLOCK_N / 8] or [BLOCK_K / 8, BLOCK_N]
tile, contiguous along the fast axis), unpacks its nibbles in registers with shifts over a third
axis of 8, subtracts the zero and feeds the tensor cores the 16-bit integers; the group's scale
multiplies the tile's product, not each weight. One pass over the packed weight, no dequantized
copy in memory (the idea Marlin builds on; the layout stays the checkpoint's, so loading never
repacks).

- AWQ ("GEMM" version): qweight [K, N/8], eight output columns per int32 in the order
  0, 2, 4, 6, 1, 3, 5, 7 (column j of a pack sits at nibble (j % 2) * 4 + j // 2); qzeros
  [K/group, N/8] packed the same way; scales [K/group, N].
- GPTQ: qweight [K/8, N], eight input rows per int32, row k at nibble k % 8; qzeros
  [K/group, N/8] with column n at nibble n % 8; scales [K/group, N]; g_idx [K], the group of
  each input row (desc_act orders rows by activation size, so groups are not contiguous).
  v1 checkpoints store zero - 1 (zero_offset=1).

W[k, n] = (q[k, n] - zero[g(k), n]) * scale[g(k), n]; symmetric weights have zero 8.

Few rows (decode) give few output tiles, so K can be split: each split writes an fp32 partial
and one small kernel adds them in split order (deterministic) and rounds to the output dtype.
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
    the weight carries g_idx. split_k 0: split K until about one wave of programs."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


# Tiles by row count: the first entry whose max rows >= m. Edit from
# `benchmarks/quant_gemm_bench.py --tune`, which prints its best launch per shape in this form.
DEFAULT_TILES: tuple[tuple[int, W4A16Config], ...] = (
    (16, W4A16Config(16, 128, 64, split_k=0, num_warps=4, num_stages=3)),
    (64, W4A16Config(32, 128, 64, split_k=0, num_warps=4, num_stages=3)),
    (128, W4A16Config(64, 128, 64, split_k=1, num_warps=8, num_stages=3)),
    (1 << 62, W4A16Config(128, 128, 64, split_k=1, num_warps=8, num_stages=3)),
)
# Launches measured best for one (max rows of its tile entry, n, k); override DEFAULT_TILES.
TUNED: dict[tuple[int, int, int], W4A16Config] = {}


def auto_split(tiles: int, k: int, block_k: int, num_sms: int) -> int:
    """Powers of two while the grid stays within about three waves and each split keeps at
    least two K steps: few rows give few output tiles, and splitting K fills the GPU (on an
    H100, Qwen3-8B's projections at 1-16 rows ran fastest at 256-384 programs)."""
    split = 1
    while tiles * split * 2 <= num_sms * 3 and k // (block_k * split * 2) >= 2:
        split *= 2
    return split


def default_config(m: int, n: int, k: int, group_size: int, num_sms: int = 132) -> W4A16Config:
    """The launch for x [m, k] and a [k, n] weight: TUNED for this shape if measured, else the
    DEFAULT_TILES entry of this row count; block_k shrinks to divide the group size."""
    bucket, tile = next((rows, c) for rows, c in DEFAULT_TILES if m <= rows)
    config = TUNED.get((bucket, n, k), tile)
    block_k = max(16, min(config.block_k, group_size, k))
    while group_size % block_k and block_k > 16:
        block_k //= 2
    split = config.split_k
    if split == 0:
        tiles = -(-m // config.block_m) * -(-n // config.block_n)
        split = auto_split(tiles, k, block_k, num_sms)
    return W4A16Config(config.block_m, config.block_n, block_k, split, config.num_warps,
                       config.num_stages)  # fmt: skip


if triton is not None:

    @triton.jit
    def _unpack_cols(packed, AWQ: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
        """[ROWS, COLS / 8] int32 -> [ROWS, COLS] nibbles, eight columns per int32 (AWQ's
        interleaved order or in sequence): one load per int32, unpacked in registers."""
        j = tl.arange(0, 8)
        if AWQ:
            shifts = ((j % 2) * 4 + j // 2) * 4
        else:
            shifts = j * 4
        q = (packed[:, :, None] >> shifts[None, None, :]) & 0xF
        return tl.reshape(q, (ROWS, COLS))

    @triton.jit
    def _unpack_rows(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
        """[ROWS / 8, COLS] int32 -> [ROWS, COLS] nibbles, eight rows per int32 (GPTQ)."""
        shifts = tl.arange(0, 8) * 4
        q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
        return tl.reshape(q, (ROWS, COLS))

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
        # packed columns (AWQ weight, zeros of both layouts) and packed rows (GPTQ weight)
        offs_pn = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        mask_m = offs_m < M
        mask_n = offs_n < N
        mask_pn = offs_pn < N // 8
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
            # q: [BLOCK_K, BLOCK_N] 4-bit values from [BLOCK_K, BLOCK_N / 8] (AWQ) or
            # [BLOCK_K / 8, BLOCK_N] (GPTQ) int32s, each read once
            if AWQ:
                packed = tl.load(qw_ptr + offs_k[:, None] * stride_qw + offs_pn[None, :],
                                 mask=mask_k[:, None] & mask_pn[None, :], other=0)  # fmt: skip
                q = _unpack_cols(packed, True, BLOCK_K, BLOCK_N)
            else:
                offs_pk = k0 // 8 + tl.arange(0, BLOCK_K // 8)
                packed = tl.load(qw_ptr + offs_pk[:, None] * stride_qw + offs_n[None, :],
                                 mask=(offs_pk < k_end // 8)[:, None] & mask_n[None, :],
                                 other=0)  # fmt: skip
                q = _unpack_rows(packed, BLOCK_K, BLOCK_N)
            if HAS_G_IDX:
                # rows of one tile may sit in any group: gather a scale (and zero) per row
                mask_w = mask_k[:, None] & mask_n[None, :]
                g = tl.load(g_ptr + offs_k, mask=mask_k, other=0)
                scale = tl.load(s_ptr + g[:, None] * stride_s + offs_n[None, :], mask=mask_w,
                                other=0.0).to(tl.float32)  # fmt: skip
                if HAS_ZEROS:
                    zp = tl.load(z_ptr + g[:, None] * stride_z + offs_pn[None, :],
                                 mask=mask_k[:, None] & mask_pn[None, :], other=0)  # fmt: skip
                    zero = _unpack_cols(zp, AWQ, BLOCK_K, BLOCK_N) + zero_offset
                else:
                    zero = 8
                w = ((q - zero).to(tl.float32) * scale).to(x.dtype)
                acc += tl.dot(x, w, input_precision=DOT_PRECISION)
            else:
                # The tile lies in one group: sum_k x (q - zero) scale = (x @ (q - zero)) scale,
                # so the scale multiplies the [BLOCK_M, BLOCK_N] product once per K step, not
                # each weight; q - zero in [-15, 15] is exact in 16-bit floats.
                g = k0 // group_size
                scale = tl.load(s_ptr + g * stride_s + offs_n, mask=mask_n, other=0.0)
                if HAS_ZEROS:
                    zp = tl.load(z_ptr + g * stride_z + offs_pn, mask=mask_pn, other=0)
                    zero = tl.reshape(_unpack_cols(zp[None, :], AWQ, 1, BLOCK_N), (BLOCK_N,))
                    w = (q - (zero + zero_offset)[None, :]).to(x.dtype)
                else:
                    w = (q - 8).to(x.dtype)
                part = tl.dot(x, w, input_precision=DOT_PRECISION)
                acc += part * scale.to(tl.float32)[None, :]
        out = out_ptr + split * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _sum_splits_kernel(part_ptr, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        """out = the fp32 partials [SPLITS, numel] summed in split order (deterministic), cast to
        out's dtype: one launch instead of a torch sum and a cast."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        total = tl.load(part_ptr + offs, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLITS):
            total += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[splits, M, N] fp32 partials (contiguous) -> [M, N] of dtype, summed in split order."""
    splits, m, n = partials.shape
    assert partials.dtype == torch.float32 and partials.is_contiguous()
    out = torch.empty(m, n, dtype=dtype, device=partials.device)
    block = 1024
    _sum_splits_kernel[(triton.cdiv(m * n, block),)](partials, out, m * n, SPLITS=splits,
                                                      BLOCK=block, num_warps=4)  # fmt: skip
    return out


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
    assert config.block_k % PACK == 0 and config.block_k >= 16 and config.split_k >= 1
    assert config.block_n % PACK == 0 and config.block_n >= 16, config.block_n


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
    return out[0] if splits == 1 else sum_splits(out, x.dtype)
