"""Attention through the kernels' torch references (the functions the kernel tests compare
against), written to be fast on a CPU; it runs on any device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from nanopaged.attention.base import AttentionBackend, HostArrays
from nanopaged.attention.layer import Attention
from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.kernels import paged_decode, paged_prefill, store_kv
from nanopaged.layers.backend import TORCH, Backend
from nanopaged.layers.cpu_gemm import pack_model

if TYPE_CHECKING:
    from nanopaged.layers.norm import RMSNorm
    from nanopaged.layers.rotary import RotaryEmbedding


@dataclass
class TorchMetadata(AttentionMetadata):
    """AttentionMetadata plus what the first layer of a step finds for the layers after it."""

    # The decode gather plan shared by every layer of the step, built by the first.
    decode_plan: paged_decode.DecodePlan | None = None
    # Whether some slot is -1 (a token not to store), found by the first layer.
    skips_slots: bool | None = None


class TorchAttention(AttentionBackend):
    """Rotary, then the KV store, then prefill or decode attention, one reference each."""

    name = "torch"
    ops: Backend = TORCH

    def __init__(self, pack_weights: bool = False) -> None:
        """pack_weights: bind packs bf16 GEMM weights for oneDNN where the CPU multiplies
        bf16 natively (layers/cpu_gemm; a model on the CPU only)."""
        self.pack_weights = pack_weights

    def bind(self, model: nn.Module) -> None:
        super().bind(model)
        if self.pack_weights:
            pack_model(model)

    def prepare_metadata(
        self, host: HostArrays, device: torch.device
    ) -> tuple[torch.Tensor, TorchMetadata]:
        positions, shared = self.shared_metadata(host, device)
        return positions, TorchMetadata(**shared)

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
        q, k = self.rotate(positions, q, k, rotary, q_norm, k_norm)
        return self.attend(layer, q, k, v, meta)

    @staticmethod
    def rotate(
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        rotary: RotaryEmbedding,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-head q/k norms (when given), then RoPE, each its own layer."""
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return rotary(positions, q, k)

    def attend(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: TorchMetadata,
    ) -> torch.Tensor:
        """This step's rotated K/V into layer's cache, then attention over the cache."""
        k_cache, v_cache = layer.k_cache, layer.v_cache
        layer.first_kv_pass(k, v, meta)
        scales = dict(k_scale=layer.k_scale, v_scale=layer.v_scale)
        self.store_kv(k, v, k_cache, v_cache, meta, **scales)
        if meta.is_decode:
            return self.decode(q, k_cache, v_cache, meta, layer.scale, **scales)
        return paged_prefill.paged_prefill_ref(
            q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
            layer.scale, **scales,
        )  # fmt: skip

    def store_kv(self, key, value, k_cache, v_cache, meta, k_scale=None, v_scale=None) -> None:
        """This step's K/V into the cache at meta.slot_mapping."""
        # Whether a slot is -1 (a token not to store) is read back once per step, by the first
        # layer.
        if meta.skips_slots is None:
            meta.skips_slots = bool((meta.slot_mapping < 0).any())
        store_kv.store_kv_ref(
            key, value, k_cache, v_cache, meta.slot_mapping,
            k_scale=k_scale, v_scale=v_scale, may_skip=meta.skips_slots,
        )  # fmt: skip

    def decode(self, q, k_cache, v_cache, meta, scale, k_scale=None, v_scale=None) -> torch.Tensor:
        """Decode attention of one query token per row over the cache."""
        # The gather plan is shared by every layer of the step, built by the first.
        if meta.decode_plan is None:
            meta.decode_plan = paged_decode.decode_plan(
                meta.block_tables, meta.context_lens, k_cache.shape[1]
            )
        return paged_decode.paged_decode_ref(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
            plan=meta.decode_plan, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
