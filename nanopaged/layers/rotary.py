"""Rotary position embedding (rotate-half layout), with llama3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from nanopaged.kernels.rotary import rotary_tables_ref
from nanopaged.layers.backend import UsesBackend


def _inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's scaling: slow (long-wavelength) frequencies are divided by `factor`."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(UsesBackend, nn.Module):
    """Applies RoPE to q and k at given positions from a precomputed cos/sin table (the
    Triton attention backend rotates with fused kernels over the same tables instead)."""

    def __init__(
        self, head_dim: int, max_position: int, base: float, scaling: dict | None = None
    ) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, base)
        rope_type = (scaling or {}).get("rope_type", "default")
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type != "default":
            raise ValueError(f"rope_type must be 'default' or 'llama3', got {rope_type!r}")
        positions = torch.arange(max_position, dtype=torch.float32)
        # freqs: [max_position, head_dim // 2]
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._last_cos_sin: tuple | None = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._tables(positions, q.dtype)
        # qk: [num_tokens, num_heads + num_kv_heads, head_dim]; on CPU each op's dispatch is a
        # visible share of a decode step, so q and k rotate together (the same math per element).
        qk = self.backend.rotate(_joined_heads(q, k), cos, sin)
        return qk.split([q.shape[1], k.shape[1]], dim=1)

    def _tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rotary_tables_ref's rows at positions; every layer of a step asks for the same rows,
        so they are looked up once (compared by value: a tensor may be reused)."""
        last = self._last_cos_sin
        if (
            last is None
            or last[0].shape != positions.shape
            or last[1].dtype != dtype
            or not torch.equal(last[0], positions)
        ):
            cos, sin = rotary_tables_ref(self.cos, self.sin, positions, dtype)
            last = self._last_cos_sin = (positions.clone(), cos, sin)
        return last[1], last[2]


def _joined_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim] as one
    tensor of num_heads + num_kv_heads heads: a view where k's heads follow q's in memory (q and
    k split from one packed qkv row), a concatenated copy otherwise."""
    if (
        q.dtype == k.dtype
        and q.device == k.device
        and q.stride() == k.stride()
        and q.stride(2) == 1
        and q.stride(1) == q.shape[2] == k.shape[2]
        and q.shape[0] == k.shape[0]
        and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        and k.storage_offset() == q.storage_offset() + q.shape[1] * q.shape[2]
    ):
        shape = (q.shape[0], q.shape[1] + k.shape[1], q.shape[2])
        return q.as_strided(shape, q.stride(), q.storage_offset())
    return torch.cat([q, k], dim=1)
