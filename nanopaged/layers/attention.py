"""Paged attention: store this step's K/V, then prefill or decode attention over the cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanopaged.kernels import paged_decode, paged_prefill, store_kv
from nanopaged.kernels.rotary import KVStore
from nanopaged.layers.backend import UsesBackend


@dataclass
class AttentionMetadata:
    """Everything attention needs to find a batch's tokens in the paged KV cache."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not store
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    context_lens: torch.Tensor  # [batch] int32, tokens in cache after this step
    cu_seqlens_q: torch.Tensor  # [batch + 1] int32
    max_seqlen_q: int
    max_context_len: int
    # Whether any sequence the prefill kernel runs has cached tokens before this step's
    # queries (the kernel compiles its prefix loops out when none has).
    has_prefix: bool = True
    # A step mixing decodes and prefill chunks lists its decode rows (q_len 1) first (see
    # Scheduler.schedule): these leading sequences go through the decode kernel, the rest
    # through the prefill kernel with cu_seqlens_prefill (cu_seqlens_q[num_decodes:] shifted
    # to start at 0). 0: the prefill kernel runs every row.
    num_decodes: int = 0
    cu_seqlens_prefill: torch.Tensor | None = None
    # The decode rows' launch order for the decode kernel (paged_decode.longest_first), [rows
    # through the decode kernel] int32, or None (row order).
    decode_order: torch.Tensor | None = None
    # CPU decode: the gather plan shared by every layer of the step, built by the first.
    decode_plan: paged_decode.DecodePlan | None = None
    # CPU: whether some slot is -1 (a token not to store), found by the first layer.
    skips_slots: bool | None = None
    # An 8-bit cache's first forward pass (ModelRunner.first_kv_pass), before storing:
    # "calculate": each layer sets its K and V scales from this step's K/V
    # (store_kv.calibrated_scale); "check": it records their largest |K| / k_scale and
    # |V| / v_scale in kv_peak.
    first_kv_pass: str | None = None

    @property
    def is_decode(self) -> bool:
        return self.max_seqlen_q == 1


class Attention(UsesBackend, nn.Module):
    """Multi-head attention with grouped KV heads over one layer's slice of the KV cache.

    k_cache/v_cache are views of the engine's one KV tensor, bound by the ModelRunner once it
    has sized and allocated it: [num_blocks, block_size, num_kv_heads, head_dim]. An fp8
    cache comes with k_scale/v_scale, [1] fp32 views of the runner's per-layer scales.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.kv_peak: torch.Tensor | None = None  # [2], see AttentionMetadata.first_kv_pass

    def rotary_store(self, v: torch.Tensor, meta: AttentionMetadata) -> KVStore | None:
        """What the rotary kernel needs to store this step's K/V itself (one kernel fewer per
        layer), or None: Triton backends with a cache of v's dtype only (not an 8-bit one)."""
        if not self.backend.triton or self.k_cache is None or self.k_cache.dtype != v.dtype:
            return None
        return v, self.k_cache, self.v_cache, meta.slot_mapping

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        stored: bool = False,
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
        # stored: the rotary kernel already wrote k and v into the cache (rotary_store).
        assert self.k_cache is not None, "KV cache not bound"
        k_cache, v_cache = self.k_cache, self.v_cache
        if meta.first_kv_pass is not None and self.k_scale is not None:
            assert not stored, "an 8-bit cache is stored here, after this pass"
            if meta.first_kv_pass == "calculate":
                self.k_scale.copy_(store_kv.calibrated_scale(k, k_cache.dtype))
                self.v_scale.copy_(store_kv.calibrated_scale(v, v_cache.dtype))
            else:
                self.kv_peak[0] = k.abs().amax().float() / self.k_scale[0]
                self.kv_peak[1] = v.abs().amax().float() / self.v_scale[0]
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        if self.backend.triton:
            if not stored and store_kv.is_fp8(k_cache.dtype) and not meta.is_decode:
                # The prefill kernel takes this step's K/V as stored (8-bit values, cast back)
                # and reads them contiguously, not through the block table.
                k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
                v_out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
                store_kv.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, **scales,
                                  k_out=k_out, v_out=v_out)
                k, v = k_out, v_out
            elif not stored:
                store_kv.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
            return gpu_attention(q, k, v, k_cache, v_cache, meta, self.scale, **scales)
        assert not stored, "only the Triton rotary kernel stores K/V"
        self.backend.store_kv(k, v, k_cache, v_cache, meta, **scales)
        if meta.is_decode:
            return self.backend.decode_attention(q, k_cache, v_cache, meta, self.scale, **scales)
        return paged_prefill.paged_prefill_ref(
            q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
            self.scale, **scales,
        )  # fmt: skip


def gpu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernels over a step whose K/V are already stored: decode rows through the
    decode kernel, prefill chunks through the prefill kernel (reading this step's k/v
    directly: as the cache holds them, so an 8-bit cache's values cast back, store_kv's
    k_out / v_out), a mixed step's leading decode rows split off into the decode kernel."""
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if meta.is_decode:
        return paged_decode.paged_decode(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
            max_context_len=meta.max_context_len, order=meta.decode_order, **scales,
        )  # fmt: skip
    nd = meta.num_decodes
    out = None
    cu_seqlens = meta.cu_seqlens_q
    if nd:
        out = torch.empty_like(q)
        paged_decode.paged_decode(
            q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.context_lens[:nd], scale,
            max_context_len=meta.max_context_len, out=out[:nd], order=meta.decode_order,
            **scales,
        )  # fmt: skip
        assert meta.cu_seqlens_prefill is not None
        cu_seqlens = meta.cu_seqlens_prefill
    prefill = paged_prefill.paged_prefill(
        q[nd:], k_cache, v_cache, meta.block_tables[nd:], cu_seqlens, meta.context_lens[nd:],
        scale, max_seqlen_q=meta.max_seqlen_q, k_new=k[nd:], v_new=v[nd:],
        has_prefix=meta.has_prefix, out=None if out is None else out[nd:], **scales,
    )  # fmt: skip
    return prefill if out is None else out
