"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from nanopaged.layers.backend import UsesBackend


class RMSNorm(UsesBackend, nn.Module):
    """Root-mean-square norm computed in fp32, as the reference models do."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # With a residual: (norm(x + residual), x + residual), the sum the next residual.
        return self.backend.rms_norm(x, self.weight, self.eps, residual)
