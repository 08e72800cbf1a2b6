"""silu(gate) * up over a packed gate_up projection output, in one pass."""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use silu_and_mul_ref
    triton = None


# fp32 elements of one slice of silu_and_mul_ref's 16-bit path
SLICE_ELEMENTS = 1 << 18


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference: x [num_tokens, 2 * d] -> silu(x[:, :d]) * x[:, d:] in fp32 (fp64 stays
    fp64), rounded once."""
    work = torch.promote_types(x.dtype, torch.float32)
    if work == x.dtype:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    # 16-bit x (also the CPU's bf16 path): in slices of rows whose fp32 copies stay in cache,
    # each updated in place, rounded once into the output.
    d = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * d)
    step = max(1, SLICE_ELEMENTS // d)
    out = torch.empty(rows.shape[0], d, dtype=x.dtype, device=x.device)
    for start in range(0, rows.shape[0], step):
        part = rows[start : start + step]
        acc = part[:, :d].to(work)
        F.silu(acc, inplace=True)
        acc.mul_(part[:, d:].to(work))
        out[start : start + step] = acc
    return out.view(*x.shape[:-1], d)


if triton is not None:

    @triton.jit
    def _silu_and_mul_kernel(
        x_ptr, out_ptr, d, stride_x, stride_o,
        BLOCK: tl.constexpr,
    ):
        # Grid: (num_tokens, cdiv(d, BLOCK)); each program does BLOCK columns of one token.
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d
        row = x_ptr + token * stride_x
        gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(row + d + cols, mask=mask, other=0.0).to(tl.float32)
        # Same formula as torch's silu kernel: x / (1 + exp(-x)).
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + token * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, 2 * d] (rows may be strided) -> new [num_tokens, d] = silu(gate) * up."""
    assert triton is not None, "silu_and_mul needs triton; use silu_and_mul_ref"
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1, (x.shape, x.stride())
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or d == 0:
        return out
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
        x, out, d, x.stride(0), out.stride(0), BLOCK=block, num_warps=4,
    )
    return out
