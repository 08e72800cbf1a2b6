"""Which shard this rank holds, and the collectives the sharded layers need."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanopaged.platform import platform_of, synchronize

# On CUDA, sums of up to this many bytes (every decode step's, small prefill chunks') go
# through PeerAllReduce, larger ones through NCCL; NANOPAGED_PEER_ALL_REDUCE=0 sends all of
# them through NCCL.
PEER_ALL_REDUCE_BYTES = 16 * 2**20
PEER_ALL_REDUCE_ENV = "NANOPAGED_PEER_ALL_REDUCE"


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
    peer: PeerAllReduce | None = None  # set by enable_peer_all_reduce
    # On rank 0: held around each call into the group. A worker's failure aborts the group
    # only outside these calls (an abort stuck behind a CUDA graph's NCCL kernels holds the
    # group's own lock, and a call made then would wait on it for good); once the failure is
    # known, entering raises the worker's error instead.
    guard: AbstractContextManager | None = None

    def enable_peer_all_reduce(self, device: torch.device) -> bool:
        """Collective: sum small tensors through peer memory from now on, if every rank can
        (CUDA, peer access between every pair of GPUs, CUDA IPC); whether it is on."""
        # The environment is the same on every rank (workers inherit it): no collective yet.
        if (
            self.size == 1
            or not platform_of(device).gpu
            or os.environ.get(PEER_ALL_REDUCE_ENV) == "0"
        ):
            return False
        if self.min_over_ranks(int(PeerAllReduce.supported(self.size))):
            from nanopaged.distributed.cuda_ipc import PeerMapError

            try:
                self.peer = PeerAllReduce(self, device, PEER_ALL_REDUCE_BYTES)
            except PeerMapError as e:  # every rank gets here together
                warnings.warn(f"all-reduces go through NCCL: {e}", stacklevel=2)
        return self.peer is not None

    def abort(self) -> None:
        """A peer is gone: this rank's waiting or queued peer all-reduces return at once."""
        if self.peer is not None:
            self.peer.abort()

    def release(self) -> None:
        """Free the peer buffers (before leaving the process group), once this rank's kernels,
        and so every peer's reads of its buffer, are done."""
        if self.peer is not None:
            synchronize(self.peer.ptrs.device)
            self.peer.blocks.close()
            self.peer = None

    def shard(self, total: int) -> int:
        """This rank's share of `total` items split evenly (checked divisible beforehand)."""
        assert total % self.size == 0, f"{total} is not divisible by {self.size}"
        return total // self.size

    def _call(self, collective: Callable, *args, **kwargs) -> None:
        """One call into the group (under guard); a failure becomes the worker's error when a
        worker reported one."""
        try:
            with self.guard or nullcontext():
                collective(*args, group=self.group, **kwargs)
        except RuntimeError as e:
            if self.collective_failed is not None:
                self.collective_failed(e)  # raises the worker's error when one was reported
            raise

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        if self.size == 1:
            return x
        if self.peer is not None and self.peer.fits(x):
            self.peer.all_reduce(x)
            return x
        self._call(dist.all_reduce, x)
        return x

    def all_reduce_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        rms_norm: Callable,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(sum + residual), sum + residual), the sum that of x over the ranks: one peer
        kernel when x fits it, else the all-reduce (x summed in place), then rms_norm (the
        backend's: (x, weight, eps, residual) -> (out, x + residual))."""
        if self.size > 1:
            if self.peer is not None and self.peer.fits_rows(x, residual):
                return self.peer.all_reduce_rms_norm(x, residual, weight, eps)
            self.all_reduce(x)
        return rms_norm(x, weight, eps, residual)

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's x concatenated along the last dim; other ranks get None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        self._call(dist.gather, x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (rank 0 device's memory may differ from rank 1's)."""
        if self.size == 1:
            return value
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(
            self.group
        ) == "nccl" else torch.device("cpu")  # fmt: skip
        x = torch.tensor([value], dtype=torch.int64, device=device)
        self._call(dist.all_reduce, x, op=dist.ReduceOp.MIN)
        return int(x.item())

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x stacked in rank order, [size, *x.shape], on every rank."""
        if self.size == 1:
            return x[None]
        out = x.new_empty((self.size, *x.shape))
        self._call(dist.all_gather_into_tensor, out, x.contiguous())
        return out

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place."""
        if self.size == 1:
            return x
        self._call(dist.broadcast, x, src=0)
        return x


class PeerAllReduce:
    """Staging buffers and signal pads that every rank can address, for the one-kernel sum in
    nanopaged.kernels.all_reduce: 0.5-0.8x of NCCL's time from 1 to 1024 rows of 5120 bf16
    on two NVLinked H200s (benchmarks/all_reduce_bench.py).

    One block per rank holds the buffer (a slot of max_bytes per rank) and, after it, the pad;
    every rank maps every other rank's block through CUDA IPC
    (nanopaged.distributed.cuda_ipc).
    """

    DTYPES = (torch.bfloat16, torch.float16, torch.float32)

    @staticmethod
    def supported(size: int) -> bool:
        """This process can join: Triton and the CUDA runtime are there and every GPU pair has
        peer access (checked on every rank, then agreed; see enable_peer_all_reduce)."""
        from nanopaged.distributed.cuda_ipc import cuda_runtime
        from nanopaged.kernels.all_reduce import triton

        if triton is None or torch.cuda.device_count() < size or cuda_runtime() is None:
            return False
        return all(
            torch.cuda.can_device_access_peer(a, b)
            for a in range(size)
            for b in range(size)
            if a != b
        )

    def __init__(self, tp: TensorParallel, device: torch.device, max_bytes: int) -> None:
        from nanopaged.distributed.cuda_ipc import PeerBuffers
        from nanopaged.kernels.all_reduce import pad_words

        self.rank, self.size, self.max_bytes = tp.rank, tp.size, max_bytes
        pad_bytes = pad_words(tp.size) * 8
        buffer_bytes = tp.size * max_bytes
        # Zeroed on every rank before any rank learns where a peer's block is.
        self.blocks = PeerBuffers(tp, device, buffer_bytes + pad_bytes)
        # Host memory the kernel polls while it waits (pinned: the GPU reads it directly).
        self.abort_word = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        ptrs = self.blocks.ptrs + [p + buffer_bytes for p in self.blocks.ptrs]
        ptrs.append(self.abort_word.data_ptr())
        self.ptrs = torch.tensor(ptrs, dtype=torch.int64, device=device)

    def fits(self, x: torch.Tensor) -> bool:
        return (
            x.dtype in self.DTYPES
            and x.is_contiguous()
            and x.numel() * x.element_size() <= self.max_bytes
        )

    def fits_rows(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """x [num_rows, hidden] and its residual can go through all_reduce_rms_norm."""
        return x.dim() == 2 and self.fits(x) and residual.is_contiguous()

    def all_reduce_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, **launch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x summed over the ranks plus residual, and its RMSNorm, in one kernel."""
        from nanopaged.kernels.all_reduce import peer_all_reduce_rms_norm

        return peer_all_reduce_rms_norm(
            x, residual, weight, eps, self.ptrs, self.rank, self.size, self.max_bytes, **launch
        )

    def all_reduce(self, x: torch.Tensor, **launch) -> None:
        """Sum x in place (launch: peer_all_reduce's settings, for tests and benchmarks)."""
        from nanopaged.kernels.all_reduce import peer_all_reduce

        if x.numel():
            peer_all_reduce(x, self.ptrs, self.rank, self.size, self.max_bytes, **launch)

    def abort(self) -> None:
        self.abort_word.fill_(1)


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
