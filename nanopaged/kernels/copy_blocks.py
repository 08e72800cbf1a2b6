"""Copy whole KV blocks (every layer, K and V) from src to dst block ids."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use copy_blocks_ref
    triton = None


def copy_blocks_ref(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Torch reference.

    kv_cache: [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim].
    """
    kv_cache[:, :, dst.long()] = kv_cache[:, :, src.long()]


if triton is not None:

    @triton.jit
    def _copy_blocks_kernel(
        kv_ptr, src_ptr, dst_ptr, num_blocks,
        BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr,
    ):
        # Grid: (pair, K/V x layer, chunk of the block).
        pair = tl.program_id(0)
        plane = tl.program_id(1).to(tl.int64)
        chunk = tl.program_id(2)
        src = tl.load(src_ptr + pair)
        dst = tl.load(dst_ptr + pair)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        mask = offs < BLOCK_NUMEL
        base = kv_ptr + plane * num_blocks * BLOCK_NUMEL
        x = tl.load(base + src * BLOCK_NUMEL + offs, mask=mask)
        tl.store(base + dst * BLOCK_NUMEL + offs, x, mask=mask)


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy blocks src[i] -> dst[i] in every layer, K and V, in one launch.

    dst ids must be distinct and disjoint from src ids (copy-on-write targets are fresh blocks).
    """
    assert triton is not None, "copy_blocks needs triton; use copy_blocks_ref"
    assert kv_cache.dim() == 6 and kv_cache.shape[0] == 2, kv_cache.shape
    assert kv_cache.is_contiguous()
    assert src.dim() == 1 and src.shape == dst.shape, (src.shape, dst.shape)
    assert src.dtype == dst.dtype == torch.int64, (src.dtype, dst.dtype)
    assert src.device == dst.device == kv_cache.device
    num_pairs = src.shape[0]
    if num_pairs == 0:
        return
    if kv_cache.element_size() == 1:
        kv_cache = kv_cache.view(torch.uint8)  # an fp8 cache: copy its bytes
    _, num_layers, num_blocks = kv_cache.shape[:3]
    block_numel = kv_cache[0, 0, 0].numel()
    chunk = min(4096, triton.next_power_of_2(block_numel))
    grid = (num_pairs, 2 * num_layers, triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        kv_cache, src, dst, num_blocks, BLOCK_NUMEL=block_numel, CHUNK=chunk, num_warps=4
    )
