"""Linear layers whose parameters know how to load their (packed, tensor-parallel) shards.

Column-parallel layers split the output features over the ranks (each rank computes its
slice); row-parallel layers split the input features and sum the partial products with one
all-reduce. With a single rank both are a plain linear.
"""

from __future__ import annotations

import torch
from torch import nn

from nanopaged.distributed.parallel import TensorParallel, local_kv_heads
from nanopaged.layers.backend import UsesBackend

SINGLE = TensorParallel()


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded)


def _shard(loaded: torch.Tensor, full_shape: tuple, dim: int, start: int, length: int):
    """This rank's slice of a checkpoint tensor, after checking the tensor is whole."""
    if tuple(loaded.shape) != tuple(full_shape):
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {tuple(full_shape)}")
    return loaded.narrow(dim, start, length)


class Linear(UsesBackend, nn.Module):
    """y = x W^T (+ b), weight [output_size, input_size], the same on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # CPU bf16: the weight prepacked for oneDNN (see layers/cpu_gemm.pack_model).
        self.packed_weight: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        assert shard_id is None
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self.weight, self.bias, self.packed_weight)


class ColumnParallelLinear(Linear):
    """Output features split over the ranks: weight [output_size / tp, input_size]."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__(input_size, tp.shard(output_size), bias)
        self.tp = tp

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        assert shard_id is None
        size = param.shape[0]
        full = (size * self.tp.size, *param.shape[1:])
        default_weight_loader(param, _shard(loaded, full, 0, self.tp.rank * size, size))


class MergedColumnParallelLinear(Linear):
    """Several column-parallel linears sharing an input, stacked along the output (gate_up).

    Each rank holds its slice of every part: [gate_r; up_r].
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        shard_ids: list,
        bias: bool = False,
        tp: TensorParallel = SINGLE,
    ) -> None:
        local = [tp.shard(s) for s in output_sizes]
        super().__init__(input_size, sum(local), bias)
        self.tp = tp
        # shard id -> (offset in this rank's weight, rows, first row in the checkpoint tensor,
        # rows of the checkpoint tensor)
        self.shard_offsets: dict = {}
        offset = 0
        for shard_id, size, full in zip(shard_ids, local, output_sizes):
            self.shard_offsets[shard_id] = (offset, size, tp.rank * size, full)
            offset += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offset, size, start, full = self.shard_offsets[shard_id]
        dst = param.data.narrow(0, offset, size)
        default_weight_loader(dst, _shard(loaded, (full, *dst.shape[1:]), 0, start, size))


class QKVParallelLinear(MergedColumnParallelLinear):
    """Packed q, k, v projections, one GEMM; each rank holds its query heads and their KV heads.

    With more ranks than KV heads a KV head is copied onto every rank whose queries use it.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TensorParallel = SINGLE,
    ) -> None:
        self.num_heads = tp.shard(num_heads)
        self.num_kv_heads, first_kv_head = local_kv_heads(num_kv_heads, tp)
        q_rows, kv_rows = self.num_heads * head_dim, self.num_kv_heads * head_dim
        # Sizes as if unsplit, so the parent's even split gives each rank q_rows and kv_rows.
        super().__init__(
            hidden_size, [q_rows * tp.size, kv_rows * tp.size, kv_rows * tp.size],
            ["q", "k", "v"], bias, tp,
        )  # fmt: skip
        kv_start, kv_full = first_kv_head * head_dim, num_kv_heads * head_dim
        self.shard_offsets["k"] = (q_rows, kv_rows, kv_start, kv_full)
        self.shard_offsets["v"] = (q_rows + kv_rows, kv_rows, kv_start, kv_full)


class RowParallelLinear(Linear):
    """Input features split over the ranks: weight [output_size, input_size / tp]; the partial
    products are summed across ranks and the bias added once, after the sum.

    reduce_results=False leaves the partial product to the caller, which sums it with others
    (the MoE block's experts) or in the RMSNorm that follows (the decoder layers); rank 0's
    part then carries the bias, so the sum holds it once.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TensorParallel = SINGLE,
        reduce_results: bool = True,
    ) -> None:
        super().__init__(tp.shard(input_size), output_size, bias)
        self.tp = tp
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        assert shard_id is None
        if param.dim() == 1:  # the bias is whole on every rank
            default_weight_loader(param, loaded)
            return
        size = param.shape[1]
        full = (param.shape[0], size * self.tp.size)
        default_weight_loader(param, _shard(loaded, full, 1, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.backend.linear(x, self.weight, self.bias, self.packed_weight)
        if not self.reduce_results:
            bias = self.bias if self.tp.rank == 0 else None
            return self.backend.linear(x, self.weight, bias, self.packed_weight)
        out = self.tp.all_reduce(self.backend.linear(x, self.weight, None, self.packed_weight))
        return out if self.bias is None else out + self.bias
