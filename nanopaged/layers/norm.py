"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from nanopaged.distributed.parallel import TensorParallel
from nanopaged.layers.backend import UsesBackend
from nanopaged.layers.linear import SINGLE


class RMSNorm(UsesBackend, nn.Module):
    """Root-mean-square norm computed in fp32, as the reference models do."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        tp: TensorParallel = SINGLE,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # With a residual: (norm(x + residual), x + residual), the sum the next residual. With
        # tp of several ranks, x is this rank's part of a sum over them (a row-parallel
        # layer's unreduced output), summed first: through the peer kernel that also adds and
        # normalizes, when it can.
        if tp.size > 1:
            assert residual is not None, "a partial sum is normalized with its residual"
            return tp.all_reduce_rms_norm(x, residual, self.weight, self.eps, self.backend.rms_norm)
        return self.backend.rms_norm(x, self.weight, self.eps, residual)
