"""y = x W^T (+ bias) for decode-sized x (1 to 16 rows): a weight-streaming GEMM.

At decode the weight is the only large operand, so the kernel is a bandwidth problem: every SM
must have enough weight bytes in flight from the start. Two paths:

- M <= 4 (M <= 2 where N is large): FMAs on the CUDA cores over narrow N tiles, 1 to 4 weight
  rows a program, so thousands of small programs. Weight rows are read with 16-byte loads, x
  (tiny, in L1/L2) once per K chunk; each thread sums its products every chunk and threads
  combine once, after the loop.
- otherwise: tensor cores, W [BLOCK_N, BLOCK_K] @ x^T padded to 16 columns, behind Triton's
  cp.async pipeline.

Where N gives too few tiles (o_proj, down_proj: N = 1024) K can be split: each split writes
its fp32 partial, and the last split of an N tile to arrive (an atomic count per tile) sums the
partials in split order and writes the output. The sum is deterministic, needs no second
kernel, and the count is reset by the program that read it, so a CUDA graph replays the launch
any number of times.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanopaged.platform import platform_of

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use skinny_linear_ref
    triton = None
try:  # programmatic dependent launch (Hopper), Triton 3.4+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no triton, or an older one: skinny_linear(pdl=True) is refused
    gdc_launch_dependents = gdc_wait = None

MAX_M = 16
# Split-K tiles count their arrivals here; one zeroed buffer per device, never grown.
MAX_TILES = 1 << 16
_tile_counters: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class SkinnyGemmConfig:
    """Launch parameters: the tile, the K split, and whether the tile goes to the tensor cores.

    Without the tensor cores, block_k is best 256 or 512 times num_warps (for 16-bit dtypes):
    then every warp lies along K and the weight, x and their product share one register
    layout. num_stages applies to the tensor-core path only.
    """

    block_n: int
    block_k: int
    split_k: int = 1
    use_dot: bool = False
    num_warps: int = 4
    num_stages: int = 2


def skinny_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference: x [M, K] @ weight [N, K]^T (+ bias) accumulated in fp32, rounded once."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


def k_split(k: int, split_k: int, block_k: int) -> tuple[int, int]:
    """(K per split, number of splits) when K is cut into about split_k slices of whole
    block_k chunks: the last slice may be short, and none is empty."""
    chunks = -(-k // block_k)
    k_per_split = -(-chunks // split_k) * block_k
    return k_per_split, -(-k // k_per_split)


def default_config(m: int, n: int, k: int) -> SkinnyGemmConfig:
    """The launch for x [m, k] and weight [n, k]: within ~5% of the fastest that
    benchmarks/skinny_gemm_bench.py --tune found on an H200 at every Qwen3-0.6B and Llama-3-8B
    projection shape (two sweeps averaged)."""
    if m <= 4:
        # CUDA-core FMAs over narrow N tiles: thousands of small programs keep every SM's
        # loads in flight. Few rows a program where N is small, so the SMs still fill.
        if m == 1:
            block_n, block_k, warps = (2, 1024, 2) if k <= 1024 else (1, 1024, 4)
            if k > 1024 and n >= 2048:
                block_k = 2048
        elif m == 2:
            block_n, block_k, warps = (2, 512, 2) if k <= 1024 else (2, 1024, 4)
            if k > 1024 and n < 2048:
                block_k, warps = 2048, 8
        elif n < 2048:
            block_n, block_k, warps = 4, 1024, 4
        else:
            block_n = 0  # tensor cores, below
        if block_n:
            return SkinnyGemmConfig(block_n, block_k, num_warps=warps, num_stages=1)
    # Tensor cores (M padded to 16) behind a cp.async pipeline. K is split only where N gives
    # too few tiles or K is long: a split costs ~1 us (partials, an atomic, a second read),
    # about what streaming 4 MB costs.
    block_n = 64 if n >= 2048 else 32
    tiles = -(-n // block_n)
    split = 1
    if tiles < 48:
        while tiles * split < 128:
            split *= 2
    elif k >= 8192:
        split = 2
    block_k, stages = (256, 4) if m <= 4 else (128, 6 if block_n == 64 else 4)
    return SkinnyGemmConfig(block_n, block_k, split, use_dot=True, num_warps=4,
                            num_stages=stages)


if triton is not None:

    @triton.jit
    def _store_out(acc, bias_ptr, out_ptr, offs_n, offs_m, M, N, stride_om,
                   HAS_BIAS: tl.constexpr):
        # acc: [BLOCK_N, BLOCK_M] fp32, the transposed output tile
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
        mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _load_chunk(base, offs_kv, k, k_end, EVEN_K: tl.constexpr):
        # base: row pointers [R, 1, 1, 1]; offs_kv: [1, 1, BLOCK_K // VEC, VEC] -> the chunk at k
        if EVEN_K:
            return tl.load(base + (offs_kv + k))
        return tl.load(base + (offs_kv + k), mask=offs_kv + k < k_end, other=0.0)

    @triton.jit
    def _skinny_gemm_kernel(
        x_ptr, w_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
        M, N, K, k_per_split, stride_xm, stride_wn, stride_om,
        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
        USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # Grid: (cdiv(N, BLOCK_N), split_k); program (n, s) does BLOCK_N outputs over K slice s.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        split_k = tl.num_programs(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        # Rows past N (weight) and M (x) are clamped, not masked, so the loads stay unmasked
        # and 16 bytes wide; what they produce is never stored.
        w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        x_rows = tl.minimum(offs_m, M - 1)
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        if PDL:
            # A PDL-launched next kernel may start once every program here has begun; its
            # own wait keeps it off our output.
            gdc_launch_dependents()
        if USE_DOT:
            if PDL:
                gdc_wait()  # the pipeliner hoists loads: wait before any
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for k in range(k_start, k_end, BLOCK_K):
                offs_k = k + tl.arange(0, BLOCK_K)
                w_ptrs = w_ptr + w_rows[:, None] * stride_wn + offs_k[None, :]
                x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :]
                if EVEN_K:
                    w = tl.load(w_ptrs)  # [BLOCK_N, BLOCK_K]
                    x = tl.load(x_ptrs)  # [BLOCK_M, BLOCK_K]
                else:
                    w = tl.load(w_ptrs, mask=offs_k[None, :] < k_end, other=0.0)
                    x = tl.load(x_ptrs, mask=offs_k[None, :] < k_end, other=0.0)
                # M padded to 16 on the tensor cores: W [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, 16]
                acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
        else:
            # Tiles are 4-D, [BLOCK_N, BLOCK_M, BLOCK_K // VEC, VEC], so that each thread keeps
            # its VEC contiguous K values (one 16-byte load) for every x row: the product
            # broadcasts in registers, VEC terms are summed in-thread each step, and the
            # cross-thread sum over K happens once, after the loop.
            VEC: tl.constexpr = 128 // w_ptr.dtype.element_ty.primitive_bitwidth
            offs_kv = tl.arange(0, BLOCK_K // VEC)[None, None, :, None] * VEC
            offs_kv = offs_kv + tl.arange(0, VEC)[None, None, None, :]
            w_base = w_ptr + w_rows[:, None, None, None] * stride_wn
            x_base = x_ptr + x_rows[None, :, None, None] * stride_xm
            acc3 = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K // VEC], dtype=tl.float32)
            w = _load_chunk(w_base, offs_kv, k_start, k_end, EVEN_K)
            if PDL:
                # The weight is no earlier kernel's output: its first chunk streams in while the
                # kernel that writes x finishes. x and out wait for it.
                gdc_wait()
            for k in range(k_start, k_end, BLOCK_K):
                x = _load_chunk(x_base, offs_kv, k, k_end, EVEN_K)
                # A product of two 16-bit floats is exact in fp32; only the sums round.
                acc3 += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=3)
                # Loading the next chunk here rather than before the FMAs is faster (fewer
                # live registers, more programs an SM; measured on an H200).
                if k + BLOCK_K < k_end:
                    w = _load_chunk(w_base, offs_kv, k + BLOCK_K, k_end, EVEN_K)
            acc = tl.sum(acc3, axis=2)  # [BLOCK_N, BLOCK_M]
        if SPLIT:
            # partial: [split_k, BLOCK_M, N] fp32
            p_ptrs = partial_ptr + offs_m[None, :] * N + offs_n[:, None]
            n_mask = offs_n[:, None] < N
            tl.store(p_ptrs + pid_k * BLOCK_M * N, acc, mask=n_mask)
            # Every thread's partial is written before thread 0 announces the split (a barrier,
            # then a release); the last to arrive acquires them all.
            tl.debug_barrier()
            arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
            if arrived == split_k - 1:
                acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                for s in range(0, split_k):
                    # .cg: read the partials from L2, never from a stale L1 line.
                    acc += tl.load(p_ptrs + s * BLOCK_M * N, mask=n_mask, cache_modifier=".cg")
                tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next launch
                _store_out(acc, bias_ptr, out_ptr, offs_n, offs_m, M, N, stride_om, HAS_BIAS)
        else:
            _store_out(acc, bias_ptr, out_ptr, offs_n, offs_m, M, N, stride_om, HAS_BIAS)


def _counters(device: torch.device) -> torch.Tensor:
    """The device's zeroed split-K arrival counts (allocated on first use, outside a graph)."""
    counters = _tile_counters.get(device)
    if counters is None:
        assert not platform_of(device).is_capturing(), (
            "run skinny_linear once on this device before capturing a CUDA graph"
        )
        counters = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
        _tile_counters[device] = counters
    return counters


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyGemmConfig | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """x [M, K] (M <= 16, rows may be strided) @ weight [N, K]^T (+ bias [N]) -> new [M, N].

    pdl: launch as a programmatic dependent (Hopper): the kernel starts, and begins streaming
    the weight, before the kernel ahead of it in the stream ends, and waits for it before it
    reads x.
    """
    assert triton is not None, "skinny_linear needs triton; use skinny_linear_ref"
    assert x.dim() == 2 and weight.dim() == 2, (x.shape, weight.shape)
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= MAX_M, f"skinny_linear takes 1 to {MAX_M} rows, got {m}"
    assert weight.shape[1] == k, (x.shape, weight.shape)
    assert x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    assert x.stride(1) == 1 and weight.is_contiguous(), (x.stride(), weight.stride())
    assert x.device == weight.device
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous() and bias.device == x.device
    cfg = config or default_config(m, n, k)
    block_m = MAX_M if cfg.use_dot else triton.next_power_of_2(m)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    k_per_split, split_k = k_split(k, cfg.split_k, cfg.block_k)
    tiles = triton.cdiv(n, cfg.block_n)
    if split_k > 1:
        assert tiles <= MAX_TILES, tiles
        partial = torch.empty(split_k, block_m, n, dtype=torch.float32, device=x.device)
        counters = _counters(x.device)
    else:
        partial = counters = out  # unread placeholders
    # The FMA path is never software-pipelined: the pipeliner could hoist x's loads above the
    # PDL wait, and it gained nothing there.
    num_stages = cfg.num_stages if cfg.use_dot else 1
    launch = dict(launch_pdl=True) if pdl else {}
    assert not pdl or gdc_wait is not None, "pdl needs Triton 3.4+"
    _skinny_gemm_kernel[(tiles, split_k)](
        x, weight, bias if bias is not None else out, out, partial, counters,
        m, n, k, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT=split_k > 1, EVEN_K=k % k_per_split == 0,
        USE_DOT=cfg.use_dot, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=pdl,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=num_stages, **launch,
    )
    return out
