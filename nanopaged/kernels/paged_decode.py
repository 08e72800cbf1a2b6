"""Decode attention: one query token per sequence over its paged K/V."""

from __future__ import annotations

import torch


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> torch.Tensor:
    """Read the first context_len tokens of one sequence through its block table."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    # blocks: [num_blocks, block_size, num_kv_heads, head_dim]
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:context_len]


def paged_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch reference. q: [batch, num_heads, head_dim] -> [batch, num_heads, head_dim]."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    # k, v: [batch, max_blocks * block_size, num_kv_heads, head_dim]
    k = k_cache[block_tables.long()].reshape(batch, max_blocks * block_size, num_kv_heads, head_dim)
    v = v_cache[block_tables.long()].reshape(batch, max_blocks * block_size, num_kv_heads, head_dim)
    k = k.float().repeat_interleave(group, dim=2)
    v = v.float().repeat_interleave(group, dim=2)
    # scores: [batch, num_heads, max_blocks * block_size]
    scores = torch.einsum("bhd,bthd->bht", q.float(), k) * scale
    pos = torch.arange(max_blocks * block_size, device=q.device)
    scores.masked_fill_(pos[None, None, :] >= context_lens.to(q.device)[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bht,bthd->bhd", probs, v).to(q.dtype)
