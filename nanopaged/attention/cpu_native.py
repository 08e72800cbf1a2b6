"""Attention on a CPU through the C kernels of kernels/cpu_native.c: for a decode step rotary,
the KV store and attention in one call (bf16 and fp32 models), and the KV store and decode
attention as separate calls (bf16; decode also fp32). Anything else (prefill, an 8-bit cache)
runs the torch references."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nanopaged.attention.layer import Attention
from nanopaged.attention.torch_ref import TorchAttention, TorchMetadata
from nanopaged.kernels import cpu_native
from nanopaged.layers.backend import CPU_NATIVE, Backend

if TYPE_CHECKING:
    from nanopaged.layers.norm import RMSNorm
    from nanopaged.layers.rotary import RotaryEmbedding


def _heads_contiguous(x: torch.Tensor) -> bool:
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


class CpuNativeAttention(TorchAttention):
    """TorchAttention with the C kernels wherever the tensors are bf16, and for fp32 decode
    steps."""

    name = "cpu-native"
    ops: Backend = CPU_NATIVE

    def __init__(self, pack_weights: bool = True) -> None:
        super().__init__(pack_weights)

    def forward(
        self,
        layer: Attention,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: TorchMetadata,
        rotary: RotaryEmbedding,
        q_norm: RMSNorm | None,
        k_norm: RMSNorm | None,
    ) -> torch.Tensor:
        k_cache = layer.k_cache
        if not (
            meta.is_decode
            and q.dtype == k_cache.dtype
            and q.dtype in (torch.bfloat16, torch.float32)
            and rotary.cos.dtype == torch.float32
            and positions.dtype == meta.slot_mapping.dtype == torch.int64
        ):
            return super().forward(layer, positions, q, k, v, meta, rotary, q_norm, k_norm)
        # A decode step: rotary, the KV store and decode attention in one C call.
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return cpu_native.rotary_decode(
            q, k, v, positions, rotary.cos, rotary.sin, k_cache, layer.v_cache,
            meta.slot_mapping, meta.block_tables, meta.context_lens, layer.scale,
            meta.max_context_len,
        )  # fmt: skip

    def store_kv(self, key, value, k_cache, v_cache, meta, k_scale=None, v_scale=None) -> None:
        bf16 = k_cache.dtype == torch.bfloat16
        if not (bf16 and _heads_contiguous(key) and _heads_contiguous(value)):
            return super().store_kv(key, value, k_cache, v_cache, meta, k_scale, v_scale)
        cpu_native.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)

    def decode(self, q, k_cache, v_cache, meta, scale, k_scale=None, v_scale=None) -> torch.Tensor:
        if not (k_cache.dtype == q.dtype and q.dtype in (torch.bfloat16, torch.float32)):
            return super().decode(q, k_cache, v_cache, meta, scale, k_scale, v_scale)
        return cpu_native.paged_decode(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, meta.max_context_len
        )
