"""Linear layers whose parameters know how to load their (packed, tensor-parallel) shards.

Column-parallel layers split the output features over the ranks (each rank computes its
slice); row-parallel layers split the input features and sum the partial products with one
all-reduce. With a single rank both are a plain linear.

A quantized layer holds its format's tensors instead of `weight` (nanopaged/quantization):
each parameter says along which dim its output and input features lie and how many features
one element covers (packed 4-bit values, group or block scales), so one loader slices every
tensor of every format. After loading, the format either keeps them for its GPU kernel or
dequantizes them into a plain `weight` (CPU), and the layer is then an unquantized one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanopaged.distributed.parallel import TensorParallel, local_kv_heads
from nanopaged.layers.backend import UsesBackend
from nanopaged.quantization.base import Axis, LinearMethod, new_param

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


@dataclass(frozen=True)
class Span:
    """A run of features of one checkpoint tensor: `size` of its `full`, from `src`, landing
    at `dst` in this rank's parameter."""

    dst: int
    src: int
    size: int
    full: int

    @staticmethod
    def whole(size: int) -> Span:
        return Span(0, 0, size, size)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def load_spans(param: nn.Parameter, loaded: torch.Tensor, out: Span, inp: Span) -> None:
    """Copy the out x in features of a checkpoint tensor into param, wherever the param's
    out_axis / in_axis put them (a param without an axis is whole along it)."""
    dst, src = param.data, loaded
    full = list(param.shape)
    axes = [(getattr(param, "out_axis", Axis(0)), out), (getattr(param, "in_axis", None), inp)]
    axes = [(axis, span) for axis, span in axes if axis is not None]
    for axis, span in axes:
        full[axis.dim] = _ceil(span.full, axis.per)
    if getattr(param, "per_tensor", False):
        # one value for a whole checkpoint tensor, copied over this part's rows
        if loaded.numel() != 1:
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit (1,): the "
                             "format has one scale per tensor")  # fmt: skip
        for axis, span in axes:
            dst = dst.narrow(axis.dim, span.dst // axis.per, _ceil(span.size, axis.per))
        dst.copy_(loaded.reshape(()).expand_as(dst))
        return
    if tuple(loaded.shape) != tuple(full):
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {tuple(full)}")
    for axis, span in axes:
        length = _ceil(span.size, axis.per)
        dst = dst.narrow(axis.dim, span.dst // axis.per, length)
        src = src.narrow(axis.dim, span.src // axis.per, length)
    default_weight_loader(dst, src)


class Linear(UsesBackend, nn.Module):
    """y = x W^T (+ b), weight [output_size, input_size], the same on every rank.

    quant_method: a quantized checkpoint format's tensors instead of weight (None: float);
    out_parts: this rank's output sizes of the packed parts (q, k, v; gate, up); in_split:
    the inputs are this rank's shard.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_method: LinearMethod | None = None,
        tp: TensorParallel = SINGLE,
        out_parts: list[int] | None = None,
        in_split: bool = False,
    ) -> None:
        super().__init__()
        # This rank's features.
        self.input_size, self.output_size = input_size, output_size
        self.tp = tp
        self.quant_method = quant_method
        if quant_method is None:
            self.weight = new_param((output_size, input_size), torch.get_default_dtype(),
                                    Axis(0), Axis(1))  # fmt: skip
            # CPU bf16: the weight prepacked for oneDNN (see layers/cpu_gemm.pack_model).
            self.packed_weight: torch.Tensor | None = None
        else:
            out_split = tp.size > 1 and not in_split
            parts = out_parts or [output_size]
            quant_method.create_weights(self, input_size, parts, in_split, out_split)
        for param in self.parameters(recurse=False):
            if not hasattr(param, "weight_loader"):  # a format may load one its own way
                param.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def spans(self, shard_id) -> tuple[Span, Span]:
        """Where the output and input features of checkpoint part `shard_id` go on this rank."""
        assert shard_id is None
        return Span.whole(self.output_size), Span.whole(self.input_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        load_spans(param, loaded, *self.spans(shard_id))

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_method is None:
            return self.backend.linear(x, self.weight, bias, self.packed_weight)
        out = self.quant_method.apply(self, x)
        return out if bias is None else out + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class ColumnParallelLinear(Linear):
    """Output features split over the ranks: weight [output_size / tp, input_size]."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TensorParallel = SINGLE,
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__(input_size, tp.shard(output_size), bias, quant_method, tp)

    def spans(self, shard_id) -> tuple[Span, Span]:
        assert shard_id is None
        size = self.output_size
        out = Span(0, self.tp.rank * size, size, size * self.tp.size)
        return out, Span.whole(self.input_size)


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
        quant_method: LinearMethod | None = None,
    ) -> None:
        local = [tp.shard(s) for s in output_sizes]
        # shard id -> (offset in this rank's weight, rows, first row in the checkpoint tensor,
        # rows of the checkpoint tensor)
        self.shard_offsets: dict = {}
        offset = 0
        for shard_id, size, full in zip(shard_ids, local, output_sizes):
            self.shard_offsets[shard_id] = (offset, size, tp.rank * size, full)
            offset += size
        super().__init__(input_size, sum(local), bias, quant_method, tp, out_parts=local)

    def spans(self, shard_id) -> tuple[Span, Span]:
        offset, size, start, full = self.shard_offsets[shard_id]
        return Span(offset, start, size, full), Span.whole(self.input_size)


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
        quant_method: LinearMethod | None = None,
    ) -> None:
        num_local_heads = tp.shard(num_heads)
        num_local_kv_heads, first_kv_head = local_kv_heads(num_kv_heads, tp)
        q_rows, kv_rows = num_local_heads * head_dim, num_local_kv_heads * head_dim
        # Sizes as if unsplit, so the parent's even split gives each rank q_rows and kv_rows.
        super().__init__(
            hidden_size, [q_rows * tp.size, kv_rows * tp.size, kv_rows * tp.size],
            ["q", "k", "v"], bias, tp, quant_method,
        )  # fmt: skip
        self.num_heads, self.num_kv_heads = num_local_heads, num_local_kv_heads
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
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__(tp.shard(input_size), output_size, bias, quant_method, tp,
                         in_split=tp.size > 1)  # fmt: skip
        self.reduce_results = reduce_results

    def spans(self, shard_id) -> tuple[Span, Span]:
        assert shard_id is None
        size = self.input_size
        inp = Span(0, self.tp.rank * size, size, size * self.tp.size)
        return Span.whole(self.output_size), inp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._matmul(x, self.bias)
        if not self.reduce_results:
            return self._matmul(x, self.bias if self.tp.rank == 0 else None)
        out = self.tp.all_reduce(self._matmul(x, None))
        return out if self.bias is None else out + self.bias
