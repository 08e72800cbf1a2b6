"""Attention through the Triton kernels (CUDA): rotary kernels that also store K/V, the paged
decode and prefill kernels, a mixed step split between them, and decode-graph inputs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from nanopaged.attention.base import AttentionBackend, HostArrays, host_to_device
from nanopaged.attention.layer import Attention
from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.kernels import paged_decode, paged_prefill, store_kv
from nanopaged.kernels.rotary import KVStore, apply_rotary, qk_norm_rotary
from nanopaged.layers.backend import triton_ops

if TYPE_CHECKING:
    from nanopaged.layers.norm import RMSNorm
    from nanopaged.layers.rotary import RotaryEmbedding


@dataclass
class TritonMetadata(AttentionMetadata):
    """AttentionMetadata plus how the kernels split and order the step's rows."""

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


class TritonAttention(AttentionBackend):
    """The Triton kernels; ops: the Triton op table, with a linear of this backend's own (its
    decode graphs switch it to the skinny GEMM kernel, see graph_capture)."""

    name = "triton"

    def __init__(self) -> None:
        self.ops = triton_ops()

    def compile_ahead(self, layer: Attention, dtype: torch.dtype) -> None:
        cache = layer.k_cache
        paged_decode.compile_merge_variants(layer.num_heads, layer.head_dim, dtype, cache.dtype,
                                            cache.device)  # fmt: skip

    def prepare_metadata(
        self, host: HostArrays, device: torch.device
    ) -> tuple[torch.Tensor, TritonMetadata]:
        positions, shared = self.shared_metadata(host, device)
        cu = host["cu_seqlens_q"]
        q_lens = cu[1:] - cu[:-1]
        context_lens = host["context_lens"]
        max_seqlen_q = shared["max_seqlen_q"]
        # A mixed step's leading decode rows (the scheduler puts them first) go to the decode
        # kernel; the prefill kernel takes the rest with its own cu_seqlens.
        nd = int(np.argmax(q_lens != 1)) if max_seqlen_q > 1 else 0
        cu_prefill = host_to_device(cu[nd:] - cu[nd], device) if nd else None
        decodes = len(q_lens) if max_seqlen_q == 1 else nd
        # Every decode launch passes an order, one row's too: the decode graphs compiled the
        # kernel's ordered variants, and an unordered one would compile inside a running
        # generate (a mixed step with one decode row did, on a fresh Triton cache).
        order = None
        if decodes > 0:
            order = host_to_device(paged_decode.longest_first(context_lens[:decodes]), device)
        return positions, TritonMetadata(
            **shared,
            has_prefix=bool((context_lens[nd:] != q_lens[nd:]).any()),
            num_decodes=nd,
            cu_seqlens_prefill=cu_prefill,
            decode_order=order,
        )

    def forward(
        self,
        layer: Attention,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: TritonMetadata,
        rotary: RotaryEmbedding,
        q_norm: RMSNorm | None,
        k_norm: RMSNorm | None,
    ) -> torch.Tensor:
        # The rotary kernel also stores K/V into a cache of v's dtype (one kernel fewer per
        # layer); an 8-bit cache is stored after them, by store_kv with its scales.
        store = None
        if layer.k_cache.dtype == v.dtype:
            store = (v, layer.k_cache, layer.v_cache, meta.slot_mapping)
        q, k = self.rotate(positions, q, k, rotary, q_norm, k_norm, store)
        return self.attend(layer, q, k, v, meta, stored=store is not None)

    @staticmethod
    def rotate(
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        rotary: RotaryEmbedding,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        store: KVStore | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q and k, after the per-head q/k norms when given: one kernel for both
        norms and the rotation where they share eps and dtype (Qwen3). store: the kernel
        also writes this step's K/V into the cache."""
        if q_norm is not None:
            if q_norm.eps == k_norm.eps and q_norm.weight.dtype == k_norm.weight.dtype == q.dtype:
                return qk_norm_rotary(
                    q, k, q_norm.weight, k_norm.weight, q_norm.eps, rotary.cos, rotary.sin,
                    positions, store,
                )  # fmt: skip
            q, k = q_norm(q), k_norm(k)
        return apply_rotary(q, k, rotary.cos, rotary.sin, positions, store)

    @staticmethod
    def attend(
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: TritonMetadata,
        stored: bool = False,
    ) -> torch.Tensor:
        """This step's K/V into layer's cache unless stored (by the rotary kernel), then
        attention over it."""
        k_cache, v_cache = layer.k_cache, layer.v_cache
        if meta.first_kv_pass is not None and layer.k_scale is not None:
            assert not stored, "an 8-bit cache is stored here, after this pass"
            layer.first_kv_pass(k, v, meta)
        scales = dict(k_scale=layer.k_scale, v_scale=layer.v_scale)
        if not stored and store_kv.is_fp8(k_cache.dtype) and not meta.is_decode:
            # The prefill kernel takes this step's K/V as stored (8-bit values, cast back)
            # and reads them contiguously, not through the block table.
            k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
            v_out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
            store_kv.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, **scales,
                              k_out=k_out, v_out=v_out)  # fmt: skip
            k, v = k_out, v_out
        elif not stored:
            store_kv.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
        return paged_attention(q, k, v, k_cache, v_cache, meta, layer.scale, **scales)

    def graph_capture(self) -> contextlib.AbstractContextManager:
        # Small GEMMs take the skinny kernel in graphs only (see layers/backend.CudaLinear).
        return self.ops.linear.graphs()

    def decode_graph_inputs(
        self, max_batch_size: int, max_blocks: int, max_model_len: int, device: torch.device
    ) -> TritonGraphInputs:
        return TritonGraphInputs(max_batch_size, max_blocks, max_model_len, device)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TritonMetadata,
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


class TritonGraphInputs:
    """The decode graphs' static attention inputs. The block-table buffer is as wide as
    max_model_len needs, so no step can overflow it; padded rows get slot -1 and context 0:
    they store nothing and read nothing."""

    def __init__(
        self, max_batch_size: int, max_blocks: int, max_model_len: int, device: torch.device
    ) -> None:
        n = max_batch_size
        self.max_model_len = max_model_len
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        # The decode kernel's launch order: longest context first, then the padding rows.
        self.decode_order = torch.arange(n, dtype=torch.int32, device=device)

    def metadata(self, batch_size: int) -> TritonMetadata:
        bs = batch_size
        return TritonMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            context_lens=self.context_lens[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            max_seqlen_q=1,
            max_context_len=self.max_model_len,
            decode_order=self.decode_order[:bs],
        )

    def fill(
        self, slots: np.ndarray, tables: np.ndarray, context_lens: np.ndarray, bucket: int
    ) -> None:
        bs = len(context_lens)
        width = tables.shape[1]
        self.slot_mapping[:bs].copy_(torch.from_numpy(slots), non_blocking=True)
        self.context_lens[:bs].copy_(torch.from_numpy(context_lens), non_blocking=True)
        self.block_tables[:bs, :width].copy_(torch.from_numpy(tables), non_blocking=True)
        order = paged_decode.longest_first(context_lens)
        if bucket > bs:
            self.slot_mapping[bs:bucket].fill_(-1)
            self.context_lens[bs:bucket].fill_(0)
            order = np.concatenate([order, np.arange(bs, bucket, dtype=np.int32)])
        self.decode_order[:bucket].copy_(torch.from_numpy(order), non_blocking=True)
