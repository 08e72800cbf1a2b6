"""Gated activations."""

from __future__ import annotations

import torch
from torch import nn

from nanopaged.layers.backend import UsesBackend


class SiluAndMul(UsesBackend, nn.Module):
    """silu(gate) * up over a packed [..., 2 * d] gate_up tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.silu_and_mul(x)
