"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from nanopaged.kernels.rms_norm import rms_norm, rms_norm_ref


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as the reference models do."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            return self._fused(x, residual)
        # CPU: the kernel's reference (with a residual, the sum becomes the next residual).
        return rms_norm_ref(x, self.weight, self.eps, residual)

    def _fused(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The Triton kernel over x viewed as rows of hidden_size (copied only if it must be)."""
        shape = x.shape
        # rows: [num_rows, hidden_size]
        rows = x.reshape(-1, shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        if residual is None:
            return rms_norm(rows, self.weight, self.eps).view(shape)
        residual_rows = residual.reshape(-1, shape[-1])
        if residual_rows.stride(-1) != 1:
            residual_rows = residual_rows.contiguous()
        out, residual = rms_norm(rows, self.weight, self.eps, residual_rows)
        return out.view(shape), residual.view(shape)
