"""Block moves outside the forward pass: the CPU swap pool, swap in/out, copy-on-write."""

from __future__ import annotations

import torch

from nanopaged.kernels.copy_blocks import copy_blocks, copy_blocks_ref
from nanopaged.platform import HostCopy, platform_of, to_device


class CpuBlockPool:
    """Free list and ref counts of the CPU blocks (no prefix cache: swapped KV is private)."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 0
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def allocate(self) -> int:
        block_id = self.free_blocks.pop()
        assert self.ref_counts[block_id] == 0
        self.ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        assert self.ref_counts[block_id] > 0
        self.ref_counts[block_id] += 1

    def decref(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0
        if self.ref_counts[block_id] == 0:
            self.free_blocks.append(block_id)

    def free_all(self) -> None:
        self.ref_counts = [0] * self.num_blocks
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))


def allocate_cpu_kv_cache(kv_cache: torch.Tensor, num_blocks: int) -> torch.Tensor | None:
    """A host tensor shaped like kv_cache with num_blocks blocks; pinned when kv_cache is on a GPU.

    kv_cache: [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim].
    """
    if num_blocks == 0:
        return None
    shape = list(kv_cache.shape)
    shape[2] = num_blocks
    return torch.empty(
        shape, dtype=kv_cache.dtype, device="cpu", pin_memory=platform_of(kv_cache.device).gpu
    )


def swap_blocks(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: list[tuple[int, int]]
) -> None:
    """Copy whole blocks src_cache[:, :, s] -> dst_cache[:, :, d] for (s, d) in pairs.

    The two caches may live on different devices (device -> CPU pool, or back).
    """
    if not pairs:
        return
    if src_cache.element_size() == 1:
        # An fp8 cache: move its bytes (CPU torch has no fp8 index_copy_).
        src_cache, dst_cache = src_cache.view(torch.uint8), dst_cache.view(torch.uint8)
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=src_cache.device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=dst_cache.device)
    # blocks: [2, num_layers, len(pairs), block_size, num_kv_heads, head_dim]
    blocks = src_cache.index_select(2, src)
    if blocks.device != dst_cache.device:
        # Device -> host waits for that copy only; host -> device goes through a pinned copy,
        # so it need not block the host.
        [blocks] = HostCopy([blocks]).result()
        blocks = to_device(blocks, dst_cache.device, pin=True)
    dst_cache.index_copy_(2, dst, blocks)


def run_block_ops(
    kv_cache: torch.Tensor,
    cpu_kv_cache: torch.Tensor | None,
    blocks_to_swap_out: list[tuple[int, int]],
    blocks_to_swap_in: list[tuple[int, int]],
    blocks_to_copy: list[tuple[int, int]],
) -> None:
    """A step's block moves, before its forward pass: swap out, swap in, then copy-on-write.

    Swap-outs go first because the device blocks they free may be handed out again this very
    step (as copy-on-write targets, say); all copy-on-write pairs go in one copy_blocks call.
    """
    if blocks_to_swap_out or blocks_to_swap_in:
        assert cpu_kv_cache is not None, "swapping needs the CPU KV cache"
        swap_blocks(kv_cache, cpu_kv_cache, blocks_to_swap_out)
        swap_blocks(cpu_kv_cache, kv_cache, blocks_to_swap_in)
    if blocks_to_copy:
        copy_block_pairs(kv_cache, blocks_to_copy)


def copy_block_pairs(kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy blocks (src, dst) of every pair in one launch.

    The ids go to the device as [2, width] = src, dst rows, width even: every call then hands
    the kernel 16-byte-aligned rows, the one variant the LLM compiles at start (an odd count
    would compile another inside a running generate).
    """
    n = len(pairs)
    ids = torch.zeros(2, n + n % 2, dtype=torch.long)
    ids[:, :n] = torch.tensor(pairs, dtype=torch.long).T
    ids = to_device(ids, kv_cache.device)
    if platform_of(kv_cache.device).gpu:
        copy_blocks(kv_cache, ids[0, :n], ids[1, :n])
    else:
        copy_blocks_ref(kv_cache, ids[0, :n], ids[1, :n])
