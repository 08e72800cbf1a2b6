"""The attention layer of a decoder: one layer's slice of the KV cache and its scales; the
bound AttentionBackend runs it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.kernels import store_kv

if TYPE_CHECKING:
    from nanopaged.layers.norm import RMSNorm
    from nanopaged.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads over one layer's slice of the KV cache.

    k_cache/v_cache are views of the engine's one KV tensor, bound by the ModelRunner once it
    has sized and allocated it: [num_blocks, block_size, num_kv_heads, head_dim]. An fp8
    cache comes with k_scale/v_scale, [1] fp32 views of the runner's per-layer scales. The
    backend is bound with the model's (AttentionBackend.bind).
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        # The model's AttentionBackend (attention/base.py, which imports this module).
        self.backend = None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.kv_peak: torch.Tensor | None = None  # [2], see AttentionMetadata.first_kv_pass

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        rotary: RotaryEmbedding,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """Rotary (after per-head q/k norms, Qwen3), this step's K/V into the cache, and
        attention over it; which of them run fused is the backend's business."""
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        assert self.backend is not None, "attention backend not bound"
        assert self.k_cache is not None, "KV cache not bound"
        return self.backend.forward(self, positions, q, k, v, meta, rotary, q_norm, k_norm)

    def first_kv_pass(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """An 8-bit cache's first forward pass, before this step's K/V are stored: set the
        scales from them, or record how far past the scales they reach (kv_peak)."""
        if meta.first_kv_pass is None or self.k_scale is None:
            return
        if meta.first_kv_pass == "calculate":
            self.k_scale.copy_(store_kv.calibrated_scale(k, self.k_cache.dtype))
            self.v_scale.copy_(store_kv.calibrated_scale(v, self.v_cache.dtype))
        else:
            self.kv_peak[0] = k.abs().amax().float() / self.k_scale[0]
            self.kv_peak[1] = v.abs().amax().float() / self.v_scale[0]
