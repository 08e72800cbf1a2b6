"""Prefill attention: variable-length causal queries over their paged K/V, cached prefix included."""

from __future__ import annotations

import torch

from nanopaged.kernels.paged_decode import gather_kv


def paged_prefill_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch reference. q: [num_tokens, num_heads, head_dim] -> same shape.

    Sequence i owns queries cu_seqlens_q[i]:cu_seqlens_q[i+1]; they are its last tokens, so
    query j sits at position context_lens[i] - q_len + j and sees keys 0..that position.
    """
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for i, context_len in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        # k, v: [context_len, num_heads, head_dim]
        k = gather_kv(k_cache, block_tables[i], context_len).float().repeat_interleave(group, 1)
        v = gather_kv(v_cache, block_tables[i], context_len).float().repeat_interleave(group, 1)
        # scores: [num_heads, q_len, context_len]
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
        k_pos = torch.arange(context_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
