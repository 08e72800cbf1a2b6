"""Write this step's K/V into the paged cache at slot_mapping."""

from __future__ import annotations

import torch


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch reference: key/value [N, num_kv_heads, head_dim] into caches at slot_mapping (-1 skips)."""
    # k_cache: [num_blocks, block_size, num_kv_heads, head_dim] -> [num_slots, num_kv_heads, head_dim]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = value[keep].to(v_cache.dtype)
