"""y = x W for 4-bit weights in GPTQ's packing, dequantized in registers (W4A16).

At decode the weight bytes are the step's cost; 4-bit weights are a quarter of bf16's. The
kernel loads each packed int32 once per tile (a [BLOCK_K / 8, BLOCK_N] tile, contiguous along
N), unpacks its nibbles in registers with shifts over a third axis of 8, subtracts the zero and
feeds the tensor cores the 16-bit integers; the group's scale multiplies the tile's product, not
each weight. One pass over the packed weight, no dequantized copy in memory (the idea Marlin
builds on).

The one layout (GPTQ's): qweight [K/8, N], eight input rows per int32, row k at nibble k % 8;
qzeros [K/group, N/8] with column n at nibble n % 8; scales [K/group, N]; g_idx [K], the group
of each input row (desc_act orders rows by activation size, so groups are not contiguous). GPTQ
v1 checkpoints store zero - 1 (zero_offset=1). AWQ checkpoints hold the same values packed
along N; quantization/awq.py repacks them into this layout at load.

W[k, n] = (q[k, n] - zero[g(k), n]) * scale[g(k), n]; symmetric weights have zero 8.

Few rows (decode) give few output tiles, so K can be split: each split writes an fp32 partial
and one small kernel adds them in split order (deterministic) and rounds to the output dtype.

From DEQUANT_ROWS rows (prefill chunks, the largest decode batches) the weight is dequantized
into a temporary in one kernel and multiplied by torch's matmul: there the tile, which
dequantizes every weight once per tile of rows, is slower than the copy.

Decode rows take a GEMV kernel (no tensor cores). With 16-bit x on Hopper it works on pairs of
16-bit floats in inline assembly (_PAIRED_ASM: about 2.4 instructions a weight against 5.8 for
its fp32 path, which the interpreter, fp32 x and desc_act weights use): at one row, 1.3-1.5x
faster on an H100.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from nanopaged.kernels.paged_decode import dot_precision, num_sms
from nanopaged.platform import platform_of

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs dequantize at load (dequantize_int4)
    triton = None

PACK = 8  # 4-bit values per int32


@dataclass
class Int4Weight:
    """A 4-bit weight of in_features x out_features in the module docstring's packing."""

    qweight: torch.Tensor  # int32 [in_features / 8, out_features]
    scales: torch.Tensor  # [groups, out_features]
    qzeros: torch.Tensor | None  # int32 [groups, out_features / 8]; None: symmetric (zero 8)
    group_size: int
    g_idx: torch.Tensor | None = None  # int32 [in_features]; None: row k in k // group_size
    zero_offset: int = 0  # added to each stored zero (GPTQ v1 checkpoints store zero - 1)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * PACK

    @property
    def out_features(self) -> int:
        return self.scales.shape[1]


def unpack_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 values of 4-bit fields: packed [..] -> 8x longer along dim, value j of each int32
    from nibble j."""
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int32, device=packed.device)
    # fields: packed with a new axis of 8 after dim, each the nibble at its shift
    fields = packed.unsqueeze(dim + 1) >> shifts.view([-1] + [1] * (packed.dim() - dim - 1))
    fields = fields & 0xF
    shape = list(packed.shape)
    shape[dim] *= PACK
    return fields.reshape(shape)


def unpack_int4(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [K, N], zeros [groups, N]) as int32, zeros with zero_offset applied."""
    q = unpack_nibbles(w.qweight, 0)
    if w.qzeros is None:
        zeros = torch.full(w.scales.shape, 8, dtype=torch.int32, device=q.device)
    else:
        zeros = unpack_nibbles(w.qzeros, 1) + w.zero_offset
    return q, zeros


def without_constant_zeros(w: Int4Weight) -> Int4Weight:
    """w without its zeros where every zero is 8 (symmetric): the kernels then skip reading
    them."""
    if w.qzeros is None:
        return w
    _, zeros = unpack_int4(w)
    return replace(w, qzeros=None, zero_offset=0) if bool((zeros == 8).all()) else w


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
    the weight carries g_idx. split_k 0: split K until about one wave of programs. gemv: the
    GEMV kernel (block_m rows per program, no tensor cores) instead of the tensor-core one;
    fused_sum (GEMV with split K): the program that finishes a column block last adds the
    splits' partials in split order, instead of a second launch."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    gemv: bool = False
    fused_sum: bool = True


# Rows up to which the default launch is the GEMV kernel: on an H100 it beat the tensor-core
# kernel at 1 row (Qwen3-8B's projections, GPTQ 1.6-2.2x bf16) and lost 3-15x at 4 and 8.
M_GEMV = 1


def _gemv_tile(rows: int, block_k: int) -> W4A16Config:
    """A GEMV default for up to `rows` rows: 256 columns (1 KB of each packed row), K split
    to fill the GPU; fewer K rows a tile as rows grow, for registers (sm_90 builds of 8 rows
    at 128 K rows spill)."""
    return W4A16Config(rows, 256, block_k, split_k=0, num_warps=4, num_stages=2, gemv=True)


# Rows from which the default launch dequantizes the weight (one kernel, a temporary of the
# weight in x's dtype) and multiplies with torch's matmul instead. Qwen3-8B's projections on an
# H100, cold (docs/quantization.md): at 256 rows 1.15-3.1x faster than the tensor-core tile
# (0.38-0.61x bf16's speed against 0.17-0.39x), at 2,048 rows 2.7-4.4x (0.78-0.91x); at 128
# rows the tile still won on gate_up.
DEQUANT_ROWS = 256

# Tiles by row count: the first entry whose max rows >= m. Edit from
# `benchmarks/quant_gemm_bench.py --tune`, which prints its best launch per shape in this form.
DEFAULT_TILES: tuple[tuple[int, W4A16Config], ...] = (
    (M_GEMV, _gemv_tile(M_GEMV, 128)),
    (16, W4A16Config(16, 128, 64, split_k=0, num_warps=4, num_stages=3)),
    (64, W4A16Config(32, 128, 64, split_k=0, num_warps=4, num_stages=3)),
    (128, W4A16Config(64, 128, 64, split_k=1, num_warps=8, num_stages=3)),
    (1 << 62, W4A16Config(128, 128, 64, split_k=1, num_warps=8, num_stages=3)),
)
# Launches measured best for one (max rows of its tile entry, n, k); override DEFAULT_TILES.
TUNED: dict[tuple[int, int, int], W4A16Config] = {}


def auto_split(tiles: int, k: int, block_k: int, num_sms: int, gemv: bool = False) -> int:
    """Powers of two while the grid stays within about three waves and each split keeps at
    least two K steps: few rows give few output tiles, and splitting K fills the GPU (on an
    H100, Qwen3-8B's projections at 1-16 rows ran fastest at 256-384 programs). The GEMV
    kernel's programs are short: six waves, one K step each at least (its best launches on an
    H100 at one row, 2026-11-27: 256-768 programs)."""
    waves, steps = (6, 1) if gemv else (3, 2)
    split = 1
    while tiles * split * 2 <= num_sms * waves and k // (block_k * split * 2) >= steps:
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
        split = auto_split(tiles, k, block_k, num_sms, config.gemv)
    return replace(config, block_k=block_k, split_k=split)


if triton is not None:

    @triton.jit
    def _unpack_cols(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
        """[ROWS, COLS / 8] int32 -> [ROWS, COLS] nibbles, eight columns per int32 (the
        zeros): one load per int32, unpacked in registers."""
        shifts = tl.arange(0, 8) * 4
        q = (packed[:, :, None] >> shifts[None, None, :]) & 0xF
        return tl.reshape(q, (ROWS, COLS))

    @triton.jit
    def _unpack_rows(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
        """[ROWS / 8, COLS] int32 -> [ROWS, COLS] nibbles, eight rows per int32 (the
        weight)."""
        shifts = tl.arange(0, 8) * 4
        q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
        return tl.reshape(q, (ROWS, COLS))

    @triton.jit
    def _w4a16_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr,
        M, N, K, k_per_split, group_size, zero_offset,
        stride_xm, stride_qw, stride_s, stride_z, stride_os, stride_om,
        HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        split = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # packed columns of the zeros
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
            # q: [BLOCK_K, BLOCK_N] 4-bit values from [BLOCK_K / 8, BLOCK_N] int32s, each
            # read once
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
                    zero = _unpack_cols(zp, BLOCK_K, BLOCK_N) + zero_offset
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
                    zero = tl.reshape(_unpack_cols(zp[None, :], 1, BLOCK_N), (BLOCK_N,))
                    w = (q - (zero + zero_offset)[None, :]).to(x.dtype)
                else:
                    w = (q - 8).to(x.dtype)
                part = tl.dot(x, w, input_precision=DOT_PRECISION)
                acc += part * scale.to(tl.float32)[None, :]
        out = out_ptr + split * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _dequantize_kernel(
        qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, group_size, zero_offset,
        stride_qw, stride_s, stride_z, stride_o,
        HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
        BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """out [K, N] = (q - zero) * scale in fp32, rounded to out's dtype (dequantize_int4)."""
        offs_pk = tl.program_id(0) * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_k = offs_k < K
        mask = mask_k[:, None] & (offs_n < N)[None, :]
        mask_packed = (offs_pk < K // 8)[:, None] & (offs_n < N)[None, :]
        packed = tl.load(qw_ptr + offs_pk[:, None] * stride_qw + offs_n[None, :],
                         mask=mask_packed, other=0)  # fmt: skip
        q = _unpack_rows(packed, BLOCK_K, BLOCK_N)
        if HAS_G_IDX:
            g = tl.load(g_ptr + offs_k, mask=mask_k, other=0)
        else:
            g = offs_k // group_size
        scale = tl.load(s_ptr + g[:, None] * stride_s + offs_n[None, :], mask=mask, other=0.0)
        if HAS_ZEROS:  # each packed zero read once, unpacked in registers
            offs_pn = tl.program_id(1) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
            zp = tl.load(z_ptr + g[:, None] * stride_z + offs_pn[None, :],
                         mask=mask_k[:, None] & (offs_pn < N // 8)[None, :], other=0)  # fmt: skip
            zero = _unpack_cols(zp, BLOCK_K, BLOCK_N) + zero_offset
        else:
            zero = 8
        w = (q - zero).to(tl.float32) * scale.to(tl.float32)
        tl.store(out_ptr + offs_k[:, None] * stride_o + offs_n[None, :],
                 w.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip

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

    # GEMV kernel (few rows). A nibble becomes a float without a conversion instruction (those
    # run at an eighth of the FMA rate on sm_90): masked in place and or-ed into the mantissa of
    # 2^23, nibble n of an int32 reads as 2^23 + q * 2^s (s = 4n for n <= 4; nibbles 5-7 come
    # from the int32 shifted right by 12, one shift for three nibbles), and subtracting
    # 2^23 + zero * 2^s leaves (q - zero) * 2^s exactly. Per weight: one and-or (LOP3), one
    # subtract, one FMA per row of x; the power of two goes into x (each nibble is an input
    # row), the zero costs nothing. A tile lies in one group, so the group's scale
    # multiplies each column's sum, not each weight. Rows of x loop inside the program: the
    # packed tile is read once for all of them.

    @triton.jit
    def _magic(bits):
        """int32 values in [0, 2^23) -> 2^23 + value as fp32, by bits alone."""
        return (bits | 0x4B000000).to(tl.float32, bitcast=True)

    @triton.jit
    def _nibble(packed, hi, NIBBLE: tl.constexpr):
        """2^23 + q * 2^s as fp32 for nibble NIBBLE of each int32 (hi: packed >> 12; s = 4
        NIBBLE up to nibble 4, else 4 NIBBLE - 12), by one and-or."""
        if NIBBLE <= 4:
            return _magic(packed & (0xF << (4 * NIBBLE)))
        else:
            return _magic(hi & (0xF << (4 * NIBBLE - 12)))

    # One packed int32 (eight nibbles of one column, input rows 8 pk .. 8 pk + 7) against x's
    # pairs of those rows, on 16-bit float pairs: an and-or puts nibbles j and j + 4 into the
    # mantissas of a pair of MAGIC (128 in bf16, 1024 in fp16), the pair $6 = (MAGIC + zero)
    # twice is subtracted (exact: small integers), four paired FMAs weigh the pairs by
    # $2..$5 = (x[8 pk + j], x[8 pk + j + 4]), and the two halves add in fp32. About 2.4
    # instructions a weight where the fp32 path (_gemv_row) takes 5.8.
    _PAIRED_ASM = """
    {
    .reg .b32 t, h0, h1, h2, h3, a, lo, hi;
    lop3.b32 h0, $1, 0x000F000F, MAGIC, 0xEA;
    shr.u32 t, $1, 4;
    lop3.b32 h1, t, 0x000F000F, MAGIC, 0xEA;
    shr.u32 t, $1, 8;
    lop3.b32 h2, t, 0x000F000F, MAGIC, 0xEA;
    shr.u32 t, $1, 12;
    lop3.b32 h3, t, 0x000F000F, MAGIC, 0xEA;
    sub.rn.PAIR h0, h0, $6;
    sub.rn.PAIR h1, h1, $6;
    sub.rn.PAIR h2, h2, $6;
    sub.rn.PAIR h3, h3, $6;
    mul.rn.PAIR a, h0, $2;
    fma.rn.PAIR a, h1, $3, a;
    fma.rn.PAIR a, h2, $4, a;
    fma.rn.PAIR a, h3, $5, a;
    HALVES
    add.f32 $0, lo, hi;
    }
    """
    # bf16 halves widen to fp32 by position; fp16 ones by cvt.
    _PAIRED_BF16 = tl.constexpr(
        _PAIRED_ASM.replace("MAGIC", "0x43004300")
        .replace("PAIR", "bf16x2")
        .replace("HALVES", "shl.b32 lo, a, 16;\n and.b32 hi, a, 0xFFFF0000;")
    )
    _PAIRED_FP16 = tl.constexpr(
        _PAIRED_ASM.replace("MAGIC", "0x64006400")
        .replace("PAIR", "f16x2")
        .replace(
            "HALVES",
            "{\n .reg .f16 l, h;\n mov.b32 {l, h}, a;\n"
            " cvt.f32.f16 lo, l;\n cvt.f32.f16 hi, h;\n }",
        )
    )
    # fp16 x is scaled by 2^-6 first, so four products of 15 * 65504 / 64 sum below fp16's
    # largest value; the sums are scaled back in fp32.
    FP16_X_SCALE = tl.constexpr(64.0)

    @triton.jit
    def _x_pair(xs, lo, mask_pk):
        """int32 [BLOCK_K / 8]: the 16-bit floats xs[lo] (low half) and xs[lo + 4] (high half);
        fp16 ones times 1 / FP16_X_SCALE."""
        a = tl.load(xs + lo, mask=mask_pk, other=0.0)
        b = tl.load(xs + lo + 4, mask=mask_pk, other=0.0)
        if xs.dtype.element_ty == tl.float16:
            a = (a * (1.0 / FP16_X_SCALE)).to(tl.float16)
            b = (b * (1.0 / FP16_X_SCALE)).to(tl.float16)
        a = a.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        b = b.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return a | (b << 16)

    @triton.jit
    def _paired_sums(packed, zq, x0, x1, x2, x3, BF16: tl.constexpr):
        """[BLOCK_N] sums over the packed tile's rows of _PAIRED_ASM's eight terms."""
        zero = zq | (0x4300 if BF16 else 0x6400)
        zero = zero | (zero << 16)  # [BLOCK_N]: (MAGIC + zero) twice
        sums = tl.inline_asm_elementwise(
            _PAIRED_BF16 if BF16 else _PAIRED_FP16,
            "=r,r,r,r,r,r,r",
            [packed, x0[:, None], x1[:, None], x2[:, None], x3[:, None], zero[None, :]],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )  # [BLOCK_K / 8, BLOCK_N]
        total = tl.sum(sums, axis=0)
        if not BF16:
            total = total * FP16_X_SCALE
        return total

    @triton.jit
    def _gemv_row_paired(packed, zq, x_ptr, row, offs_pk, mask_pk, stride_xm):
        """_gemv_row for 16-bit x without g_idx, by _PAIRED_ASM (CUDA only: the interpreter
        runs no inline assembly)."""
        xs = x_ptr + row * stride_xm + offs_pk * 8
        x0 = _x_pair(xs, 0, mask_pk)
        x1 = _x_pair(xs, 1, mask_pk)
        x2 = _x_pair(xs, 2, mask_pk)
        x3 = _x_pair(xs, 3, mask_pk)
        return _paired_sums(packed, zq, x0, x1, x2, x3, x_ptr.dtype.element_ty == tl.bfloat16)

    @triton.jit
    def _gemv_row(
        packed, hi, zq, scale, x_ptr, s_ptr, z_ptr, g_ptr, row, offs_pk, mask_pk, offs_n, mask,
        stride_xm, stride_s, stride_z, zero_offset,
        HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
    ):  # fmt: skip
        """[BLOCK_N] sums of one row of x over a packed tile: nibble i of packed row pk is input
        row 8 pk + i, so the eight nibbles add up in each thread before one reduction."""
        t = tl.zeros(packed.shape, dtype=tl.float32)
        for i in tl.static_range(8):
            SHIFT = 4 * i - 12 * (i > 4)  # see _nibble
            q = _nibble(packed, hi, i)  # [BLOCK_K / 8, BLOCK_N]: 2^23 + q * 2^SHIFT
            x = tl.load(x_ptr + row * stride_xm + offs_pk * 8 + i, mask=mask_pk, other=0.0)
            x = x.to(tl.float32) * (1.0 / (1 << SHIFT))
            if HAS_G_IDX:
                # rows of a tile may sit in any group: a scale and zero per weight
                gk = tl.load(g_ptr + offs_pk * 8 + i, mask=mask_pk, other=0)
                s = tl.load(s_ptr + gk[:, None] * stride_s + offs_n[None, :], mask=mask, other=0.0)
                z = 8
                if HAS_ZEROS:
                    zp = tl.load(z_ptr + gk[:, None] * stride_z + (offs_n // 8)[None, :],
                                 mask=mask, other=0)  # fmt: skip
                    z = ((zp >> (offs_n % 8)[None, :] * 4) & 0xF) + zero_offset
                w = (q - _magic(z << SHIFT)) * s.to(tl.float32)
            else:
                w = q - _magic(zq << SHIFT)[None, :]
            t += x[:, None] * w
        return tl.sum(t, axis=0)

    @triton.jit
    def _gemv_block(
        x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, dest, M, N, k_start, k_end, group_size, zero_offset,
        stride_xm, stride_qw, stride_s, stride_z, stride_d, pid_n, row0,
        HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr, PAIRED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """dest [rows, this block's columns] = the weight's sums over K rows [k_start, k_end);
        PAIRED: by _gemv_row_paired."""
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rows = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_pk = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            mask_pk = offs_pk < k_end // 8
            mask = mask_pk[:, None] & mask_n[None, :]
            # packed: [BLOCK_K / 8, BLOCK_N] int32, each row's BLOCK_N int32s contiguous
            packed = tl.load(qw_ptr + offs_pk[:, None] * stride_qw + offs_n[None, :], mask=mask,
                             other=0)  # fmt: skip
            hi = packed >> 12
            g = k0 // group_size
            scale = 1.0
            zq = tl.full((BLOCK_N,), 8, tl.int32)  # the column's zero (symmetric: 8)
            if not HAS_G_IDX:
                scale = tl.load(s_ptr + g * stride_s + offs_n, mask=mask_n, other=0.0)
                scale = scale.to(tl.float32)
                if HAS_ZEROS:
                    zp = tl.load(z_ptr + g * stride_z + offs_n // 8, mask=mask_n, other=0)
                    zq = ((zp >> (offs_n % 8) * 4) & 0xF) + zero_offset
            tile = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for r in tl.static_range(BLOCK_M):
                # rows past M read row M - 1: never stored, and no row mask per load
                row = tl.minimum(row0 + r, M - 1)
                if PAIRED:
                    part = _gemv_row_paired(packed, zq, x_ptr, row, offs_pk, mask_pk, stride_xm)
                else:
                    part = _gemv_row(packed, hi, zq, scale, x_ptr, s_ptr, z_ptr, g_ptr, row,
                                     offs_pk, mask_pk, offs_n, mask, stride_xm, stride_s,
                                     stride_z, zero_offset, HAS_ZEROS, HAS_G_IDX)  # fmt: skip
                tile += tl.where(rows[:, None] == r, part[None, :], 0.0)
            acc += tile * scale
        rows = row0 + rows
        mask = (rows < M)[:, None] & mask_n[None, :]
        tl.store(dest + rows[:, None] * stride_d + offs_n[None, :], acc.to(dest.dtype.element_ty),
                 mask=mask)  # fmt: skip

    @triton.jit
    def _sum_if_last(
        part_ptr, out_ptr, count_ptr, M, N, stride_om, pid_n, pid_m,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    ):  # fmt: skip
        """Called after a split stored its fp32 partial [M, N] at part_ptr + split * M * N: the
        program that finishes its column block's splits last adds them in split order
        (deterministic) and writes out. One thread counts after a barrier (every thread's
        stores come first); the count is acquire-release at GPU scope, and the last program
        resets it for the next launch."""
        tl.debug_barrier()
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_n
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = (rows < M)[:, None] & (cols < N)[None, :]
            offs = rows[:, None] * N + cols[None, :]
            # .cg: read from L2, where the other programs' partials are
            total = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLITS):
                total += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
                     total.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _w4a16_gemv_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, part_ptr, count_ptr,
        M, N, K, k_per_split, group_size, zero_offset,
        stride_xm, stride_qw, stride_s, stride_z, stride_om,
        HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr, PAIRED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLITS: tl.constexpr, FUSED_SUM: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        split = tl.program_id(2)
        k_start = split * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        if SPLITS == 1:
            dest = out_ptr
            stride_d = stride_om
        else:  # fp32 partials [SPLITS, M, N]
            dest = part_ptr + split * M * N
            stride_d = N
        row0 = pid_m * BLOCK_M
        _gemv_block(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, dest, M, N, k_start, k_end, group_size,
                    zero_offset, stride_xm, stride_qw, stride_s, stride_z, stride_d, pid_n, row0,
                    HAS_ZEROS, HAS_G_IDX, PAIRED, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        if SPLITS > 1 and FUSED_SUM:
            _sum_if_last(part_ptr, out_ptr, count_ptr, M, N, stride_om, pid_n, pid_m, BLOCK_M,
                         BLOCK_N, SPLITS)  # fmt: skip


def dequantize(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """dequantize_int4 in one kernel: the weight as [K, N] of dtype."""
    k, n = w.in_features, w.out_features
    out = torch.empty(k, n, dtype=dtype, device=w.qweight.device)
    zeros = w.qzeros if w.qzeros is not None else w.qweight  # unread without zeros
    g_idx = w.g_idx if w.g_idx is not None else w.qweight  # unread without g_idx
    block_k, block_n = 64, 128
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _dequantize_kernel[grid](
        w.qweight, w.scales, zeros, g_idx, out, n, k, w.group_size, w.zero_offset,
        w.qweight.stride(0), w.scales.stride(0), zeros.stride(0), out.stride(0),
        HAS_ZEROS=w.qzeros is not None, HAS_G_IDX=w.g_idx is not None,
        BLOCK_K=block_k, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return out


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
    assert x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1, (x.shape, k)
    assert w.qweight.dtype == torch.int32 and w.qweight.is_contiguous()
    assert w.scales.is_contiguous() and w.scales.shape == (w.scales.shape[0], n)
    assert n % PACK == 0 and k % PACK == 0, (k, n)
    assert tuple(w.qweight.shape) == (k // PACK, n), (tuple(w.qweight.shape), k, n)
    if w.qzeros is not None:
        assert w.qzeros.dtype == torch.int32 and w.qzeros.is_contiguous()
        assert tuple(w.qzeros.shape) == (w.scales.shape[0], n // PACK)
    if w.g_idx is None:
        assert w.group_size % config.block_k == 0, (w.group_size, config.block_k)
    else:
        assert w.g_idx.dtype == torch.int32 and tuple(w.g_idx.shape) == (k,)
    assert config.block_k % PACK == 0 and config.block_k >= 16 and config.split_k >= 1
    assert config.block_n % PACK == 0 and config.block_n >= 16, config.block_n
    if config.gemv:  # aranges of block_m rows, block_n / 8 packs and block_k / 8 packed rows
        for size in (config.block_m, config.block_n // PACK, config.block_k // PACK):
            assert size & (size - 1) == 0, config


MAX_COUNTERS = 1 << 16  # column blocks x row tiles of one fused-sum GEMV launch
_counters: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device) -> torch.Tensor:
    """The device's int32 counters of finished splits, zero between launches (each launch's
    last program resets its own). Allocated once and never replaced, so CUDA graphs that
    captured them stay valid; launches on one device must not overlap in time."""
    if device not in _counters:
        _counters[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def w4a16_gemm(x: torch.Tensor, w: Int4Weight, config: W4A16Config | None = None) -> torch.Tensor:
    """x [M, K] (16-bit; fp32 too, as the interpreter runs) @ w -> [M, N] in x's dtype; the
    GEMV kernel where the config says so (by default up to M_GEMV rows), else tensor cores;
    by default from DEQUANT_ROWS rows, the dequantized weight through torch's matmul."""
    m = x.shape[0]
    k, n = w.in_features, w.out_features
    if config is None:
        if m >= DEQUANT_ROWS:
            return x @ dequantize(w, x.dtype)
        config = default_config(m, n, k, w.group_size, num_sms(x.device))
    _check(x, w, config)
    k_per_split = -(-k // (config.split_k * config.block_k)) * config.block_k
    splits = -(-k // k_per_split)
    if m == 0:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), splits)
    if config.gemv:
        return _gemv(x, w, config, grid, k_per_split)
    if splits == 1:
        out = torch.empty(1, m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    zeros = w.qzeros if w.qzeros is not None else w.qweight  # unread without zeros
    g_idx = w.g_idx if w.g_idx is not None else w.qweight  # unread without g_idx
    _w4a16_kernel[grid](
        x, w.qweight, w.scales, zeros, g_idx, out,
        m, n, k, k_per_split, w.group_size, w.zero_offset,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), zeros.stride(0),
        out.stride(0), out.stride(1),
        HAS_ZEROS=w.qzeros is not None, HAS_G_IDX=w.g_idx is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        DOT_PRECISION=dot_precision(x.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out[0] if splits == 1 else sum_splits(out, x.dtype)


def paired_gemv(x: torch.Tensor, w: Int4Weight) -> bool:
    """Whether the GEMV kernel takes its paired 16-bit path (_gemv_row_paired): 16-bit x on an
    NVIDIA GPU of compute capability 9.0 or later (bf16x2 sub and mul; the one verified), rows in
    groups (no g_idx). fp32 x, desc_act weights, other GPUs and the interpreter take the fp32
    one."""
    if x.dtype not in (torch.bfloat16, torch.float16) or w.g_idx is not None:
        return False
    capability = platform_of(x.device).compute_capability(x.device)
    return capability is not None and capability >= (9, 0) and torch.version.hip is None


def _gemv(x: torch.Tensor, w: Int4Weight, config: W4A16Config, grid: tuple[int, int, int],
          k_per_split: int) -> torch.Tensor:  # fmt: skip
    """The GEMV kernel's launch: one pass, or fp32 partials summed by the last split (fused)
    or by sum_splits."""
    m, n, splits = x.shape[0], w.out_features, grid[2]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    fused = splits > 1 and config.fused_sum
    counters = split_counters(x.device) if fused else part  # unread without a fused sum
    assert not fused or grid[0] * grid[1] <= counters.numel(), grid
    zeros = w.qzeros if w.qzeros is not None else w.qweight  # unread without zeros
    g_idx = w.g_idx if w.g_idx is not None else w.qweight  # unread without g_idx
    _w4a16_gemv_kernel[grid](
        x, w.qweight, w.scales, zeros, g_idx, out, part, counters,
        m, n, w.in_features, k_per_split, w.group_size, w.zero_offset,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), zeros.stride(0), out.stride(0),
        HAS_ZEROS=w.qzeros is not None, HAS_G_IDX=w.g_idx is not None,
        PAIRED=paired_gemv(x, w),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLITS=splits, FUSED_SUM=config.fused_sum,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if splits > 1 and not config.fused_sum:
        return sum_splits(part, x.dtype)
    return out
