"""RMSNorm over rows, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use rms_norm_ref
    triton = None


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: the norm in fp32, rounded to x.dtype, then times weight in that dtype."""
    if residual is not None:
        residual = x + residual
        return rms_norm_ref(residual, weight, eps), residual
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


if triton is not None:

    @triton.jit
    def rms_normalize(x, w, inv_hidden, eps):
        """Rows of x [rows, BLOCK_N] (zero past the hidden size) normalized in fp32, rounded to
        x's dtype, times w [1, BLOCK_N], in fp32 (the caller rounds): rms_norm_ref's arithmetic."""
        xf = x.to(tl.float32)
        # torch's CUDA mean multiplies the sum by fp32(1 / n); do the same.
        mean_sq = tl.sum(xf * xf, axis=1, keep_dims=True) * inv_hidden
        y = (xf * tl.rsqrt(mean_sq + eps)).to(x.dtype).to(tl.float32)
        # A product of two 16-bit floats is exact in fp32, so one rounding equals torch's.
        return y * w.to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
        num_rows, hidden, inv_hidden, eps,
        stride_x, stride_r, stride_o, stride_nr,
        HAS_RESIDUAL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # One program normalizes BLOCK_ROWS whole rows; BLOCK_N covers the hidden size.
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_N)
        row_off = rows.to(tl.int64)[:, None]
        mask = (rows[:, None] < num_rows) & (cols[None, :] < hidden)
        x = tl.load(x_ptr + row_off * stride_x + cols[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row_off * stride_r + cols[None, :], mask=mask, other=0.0)
            # Rounded to x's dtype before the norm reads it, as torch's x + residual is.
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(new_residual_ptr + row_off * stride_nr + cols[None, :], x, mask=mask)
        w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0)
        out = rms_normalize(x, w[None, :], inv_hidden, eps).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row_off * stride_o + cols[None, :], out, mask=mask)


def _launch_config(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_ROWS, num_warps): small rows (q/k heads) are packed several a program."""
    block_n = triton.next_power_of_2(hidden)
    block_rows = max(1, 1024 // block_n)
    num_warps = 8 if block_n >= 4096 else 4
    return block_n, block_rows, num_warps


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [num_rows, hidden] (rows may be strided); with residual, also x + residual.

    Returns out, or (out, new_residual) where new_residual = x + residual and out is its norm.
    Both are new contiguous tensors; x and residual are left untouched.
    """
    assert triton is not None, "rms_norm needs triton; use rms_norm_ref"
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    num_rows, hidden = x.shape
    assert weight.shape == (hidden,) and weight.is_contiguous(), weight.shape
    assert weight.device == x.device
    # torch promotes weight * normed, so an fp32 weight over bf16 x gives fp32 out.
    out = torch.empty(num_rows, hidden, dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    has_residual = residual is not None
    if has_residual:
        assert residual.shape == x.shape and residual.stride(1) == 1, residual.shape
        assert residual.dtype == x.dtype and residual.device == x.device
        new_residual = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    else:
        residual = new_residual = x  # unread placeholders
    if num_rows > 0:
        block_n, block_rows, num_warps = _launch_config(hidden)
        _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
            x, residual, weight, out, new_residual,
            num_rows, hidden, 1.0 / hidden, eps,
            x.stride(0), residual.stride(0), out.stride(0), new_residual.stride(0),
            HAS_RESIDUAL=has_residual, BLOCK_ROWS=block_rows, BLOCK_N=block_n,
            num_warps=num_warps,
        )
    return (out, new_residual) if has_residual else out
