"""Linear layers whose parameters know how to load their (packed) shards."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x W^T (+ b), weight [output_size, input_size]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        assert shard_id is None
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several linears sharing an input, stacked along the output (gate_up, qkv)."""

    def __init__(
        self, input_size: int, output_sizes: list[int], shard_ids: list, bias: bool = False
    ) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.shard_offsets = {}
        offset = 0
        for shard_id, size in zip(shard_ids, output_sizes):
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offset, size = self.shard_offsets[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), loaded)


class QKVLinear(MergedLinear):
    """Packed q, k, v projections: one GEMM, shards "q", "k", "v"."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, ["q", "k", "v"], bias)
