"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.kernels.silu_and_mul import silu_and_mul


class SiluAndMul(nn.Module):
    """silu(gate) * up over a packed [..., 2 * d] gate_up tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            # rows: [num_tokens, 2 * d] -> [num_tokens, d]
            rows = x.reshape(-1, x.shape[-1])
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            return silu_and_mul(rows).view(*x.shape[:-1], x.shape[-1] // 2)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
