"""Copy whole KV blocks (every layer, K and V) from src to dst block ids."""

from __future__ import annotations

import torch


def copy_blocks_ref(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Torch reference. kv_cache: [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]."""
    kv_cache[:, :, dst.long()] = kv_cache[:, :, src.long()]
