"""Which shard this rank holds, and the collectives the sharded layers need."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TensorParallel:
    """This rank's place in the tensor-parallel group; size 1 means no group at all.

    group carries the model's collectives (NCCL on CUDA, gloo on CPU). On rank 0,
    collective_failed turns a failed collective into the error the failing worker reported.
    """

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    collective_failed: Callable[[BaseException], None] | None = None

    def shard(self, total: int) -> int:
        """This rank's share of `total` items split evenly (checked divisible beforehand)."""
        assert total % self.size == 0, f"{total} is not divisible by {self.size}"
        return total // self.size

    def _failed(self, error: BaseException) -> None:
        if self.collective_failed is not None:
            self.collective_failed(error)  # raises the worker's error when one was reported
        raise error

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        if self.size == 1:
            return x
        try:
            dist.all_reduce(x, group=self.group)
        except RuntimeError as e:
            self._failed(e)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's x concatenated along the last dim; other ranks get None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        try:
            dist.gather(x, parts, dst=0, group=self.group)
        except RuntimeError as e:
            self._failed(e)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (rank 0 device's memory may differ from rank 1's)."""
        if self.size == 1:
            return value
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(
            self.group
        ) == "nccl" else torch.device("cpu")  # fmt: skip
        x = torch.tensor([value], dtype=torch.int64, device=device)
        try:
            dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group)
        except RuntimeError as e:
            self._failed(e)
        return int(x.item())

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place."""
        if self.size == 1:
            return x
        try:
            dist.broadcast(x, src=0, group=self.group)
        except RuntimeError as e:
            self._failed(e)
        return x


def check_tp_shapes(
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    size: int,
    other_sizes: dict[str, int] | None = None,
) -> None:
    """ValueError unless the attention heads and the MLP split evenly over `size` ranks;
    other_sizes: further split dimensions by their config.json names (the experts' widths)."""
    if num_heads % size:
        raise ValueError(
            f"tensor_parallel_size={size} must divide the model's num_attention_heads "
            f"({num_heads})"
        )
    if num_kv_heads >= size and num_kv_heads % size:
        raise ValueError(
            f"tensor_parallel_size={size} must divide the model's num_key_value_heads "
            f"({num_kv_heads})"
        )
    if num_kv_heads < size and size % num_kv_heads:
        raise ValueError(
            f"with more ranks than KV heads, tensor_parallel_size={size} must be a multiple of "
            f"num_key_value_heads ({num_kv_heads}) so each rank copies one whole KV head"
        )
    sizes = {"intermediate_size": intermediate_size, **(other_sizes or {})}
    for name, value in sizes.items():
        if value % size:
            raise ValueError(
                f"tensor_parallel_size={size} must divide the model's {name} ({value})"
            )


def local_kv_heads(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(KV heads this rank holds, index of its first KV head in the checkpoint).

    With more ranks than KV heads each rank holds a copy of the one head its query heads use.
    """
    if num_kv_heads >= tp.size:
        per_rank = num_kv_heads // tp.size
        return per_rank, tp.rank * per_rank
    ranks_per_head = tp.size // num_kv_heads
    return 1, tp.rank // ranks_per_head
