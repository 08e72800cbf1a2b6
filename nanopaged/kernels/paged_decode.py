"""Decode attention: one query token per sequence over its paged K/V."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from nanopaged.kernels.store_kv import is_fp8, v_layout_ok
from nanopaged.platform import platform_of

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use paged_decode_ref
    triton = None


def gather_kv(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Read the first context_len tokens of one sequence through its block table, in dtype
    (an fp8 cache's values times its [1] scale)."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    # blocks: [num_blocks, block_size, num_kv_heads, head_dim] (index_select: see
    # paged_decode_ref)
    blocks = cache.index_select(0, block_table[:num_blocks])
    return dequantize(blocks.reshape(-1, *cache.shape[2:])[:context_len], scale, dtype)


def dequantize(
    x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """x in dtype; an fp8 x times its [1] fp32 scale first (what the kernels do in
    registers)."""
    if is_fp8(x.dtype):
        assert scale is not None, "an fp8 cache needs its scale"
        return (x.float() * scale).to(dtype)
    return x.to(dtype)


@dataclass
class DecodePlan:
    """What paged_decode_ref derives from block tables and lengths alone: the same for every
    layer of a step, so the CPU path builds it once per step instead of once per layer."""

    tables: torch.Tensor  # [batch * num_blocks] int32, the blocks the longest context needs
    num_tokens: int  # the longest context
    # [batch, 1, 1, num_tokens] bool, which gathered slots are inside each context; None when
    # every context is num_tokens long
    valid: torch.Tensor | None
    # [num_stale] int64: the rows of the gather ([batch * num_blocks * block_size]) past each
    # context but before num_tokens, zeroed after the gather; None with valid
    stale: torch.Tensor | None
    empty: torch.Tensor | None  # [batch] bool, contexts of length 0; None when there are none
    # valid as SDPA's additive mask (0 / -inf) per dtype, made by the first layer that asks:
    # SDPA would otherwise convert the bool mask in every layer
    _additive: dict = field(default_factory=dict, init=False, repr=False)

    def attn_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """valid as an additive mask in dtype (what SDPA makes of a bool mask), or None."""
        if self.valid is None:
            return None
        mask = self._additive.get(dtype)
        if mask is None:
            mask = torch.zeros(self.valid.shape, dtype=dtype, device=self.valid.device)
            mask.masked_fill_(~self.valid, float("-inf"))
            self._additive[dtype] = mask
        return mask


def decode_plan(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int
) -> DecodePlan:
    """The gather of paged_decode_ref for these block tables and context lengths."""
    lens = context_lens.tolist()
    max_len = max(lens, default=0)
    num_blocks = -(-max_len // block_size)
    tables = block_tables[:, :num_blocks].flatten()
    if min(lens, default=0) == max_len:
        return DecodePlan(tables, max_len, None, None, None)
    lens_t = context_lens.to(torch.long)
    pos = torch.arange(num_blocks * block_size, device=context_lens.device)
    past = pos[None, :] >= lens_t[:, None]
    stale = (past & (pos < max_len)).flatten().nonzero().flatten()
    valid = ~past[:, None, None, :max_len]
    empty = lens_t == 0
    return DecodePlan(tables, max_len, valid, stale, empty if min(lens) == 0 else None)


def paged_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: DecodePlan | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference. q: [batch, num_heads, head_dim] -> [batch, num_heads, head_dim].

    Also the CPU path: one gather of the blocks the longest context needs, then one fused
    SDPA call for the batch in q's dtype (as the kernel, whose dots take the cache's 16-bit
    values and accumulate in fp32), in which each KV head's query group plays the part of the
    query rows, so GQA needs no repeated K/V. Unequal lengths mask the slots past each context
    and zero them in the gather first, so stale values, even NaN, never reach a sum. An empty
    context yields zeros, as the kernel writes. `plan`, when given, must be
    decode_plan(block_tables, context_lens, block_size). An fp8 cache's values are multiplied
    by k_scale / v_scale ([1] fp32) in fp32, then rounded to q's dtype.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if plan is None:
        plan = decode_plan(block_tables, context_lens, k_cache.shape[1])
    if plan.num_tokens == 0:
        return torch.zeros_like(q)
    # k, v: [batch, num_kv_heads, num_tokens, head_dim], strided views of fresh gathers
    # (index_select, not advanced indexing, which on CPU threads its loop over the whole
    # cache: milliseconds per call at 2 threads)
    kv = []
    for cache, cache_scale in ((k_cache, k_scale), (v_cache, v_scale)):
        x = dequantize(cache.index_select(0, plan.tables), cache_scale, q.dtype)
        if plan.stale is not None:
            x.view(-1, num_kv_heads * head_dim).index_fill_(0, plan.stale, 0.0)
        x = x.view(batch, -1, num_kv_heads, head_dim)[:, : plan.num_tokens]
        kv.append(x.transpose(1, 2))
    # qg: [batch, num_kv_heads, group, head_dim]
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, *kv, attn_mask=plan.attn_mask(q.dtype), scale=scale)
    out = out.reshape(batch, num_heads, head_dim)
    if plan.empty is not None:  # no key at all: softmax over nothing is NaN, the kernel's 0
        out = out.masked_fill(plan.empty[:, None, None], 0.0)
    return out


@functools.cache
def num_sms(device: torch.device) -> int:
    """Multiprocessor count of a CUDA device (a host query, cached); 8 off-GPU (interpreter)."""
    return platform_of(device).num_sms(device)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 runs exact (never TF32) so the engine can match HF fp32 token for token."""
    return "ieee" if dtype == torch.float32 else "tf32"


def new_output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The kernels' output: a fresh tensor like q, or the caller's (same shape and dtype, each
    head's row contiguous)."""
    if out is None:
        return torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert out.stride(-1) == 1, out.stride()
    return out


def check_paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Asserts shared by the paged attention launchers; ValueError for unsupported shapes."""
    assert triton is not None, "paged attention kernels need triton; use the *_ref functions"
    num_heads, head_dim = q.shape[1:]
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 8, got {block_size}")
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0, (q.shape, k_cache.shape)
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    assert k_cache.dtype == v_cache.dtype, (k_cache.dtype, v_cache.dtype)
    assert k_cache.dtype == q.dtype or is_fp8(k_cache.dtype), (q.dtype, k_cache.dtype)
    assert v_cache.shape == k_cache.shape and k_cache.is_contiguous()
    # V: laid out as K, or channel-major (store_kv.channel_major, the engine's 8-bit V)
    assert v_layout_ok(k_cache, v_cache), v_cache.stride()
    assert q.stride(2) == 1, q.stride()
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2, block_tables.dtype
    assert block_tables.stride(1) == 1, block_tables.stride()
    assert context_lens.dtype == torch.int32 and context_lens.is_contiguous()
    assert context_lens.shape == (block_tables.shape[0],), (context_lens.shape, block_tables.shape)
    assert q.device == k_cache.device == block_tables.device == context_lens.device
    if is_fp8(k_cache.dtype):
        assert k_scale is not None and v_scale is not None, "an fp8 cache needs its scales"
        assert k_scale.dtype == v_scale.dtype == torch.float32, (k_scale.dtype, v_scale.dtype)
        assert k_scale.device == v_scale.device == q.device


if triton is not None:

    @triton.jit
    def _split_tokens(context_len, num_splits, BLOCK_N: tl.constexpr):
        # A sequence's tokens per split: its context cut into num_splits, rounded up to tiles.
        per_split = (context_len + num_splits - 1) // num_splits
        return (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N

    @triton.jit
    def _swapped_tile(qT, m_i, l_i, accT, k_cache_ptr, v_cache_ptr, blocks, tokens, end, dims,
                      k_head_off, v_head_off, stride_cb, stride_ct, stride_vb, stride_vt,
                      stride_vd, qk_scale, BLOCK_SIZE: tl.constexpr,
                      V_CHANNEL_MAJOR: tl.constexpr, OFFS32: tl.constexpr,
                      MASKED: tl.constexpr):
        # One online-softmax step of _swapped_tiles over BLOCK_N tokens. MASKED: the last,
        # partial tile: keys past `end` get no weight, and their V slots (stale, or block 0's
        # for positions past the table) are zeroed so that not even a NaN there reaches accT.
        # OFFS32: every offset into the caches fits in int32 (32-bit address arithmetic).
        if OFFS32:
            b64 = blocks
        else:
            b64 = blocks.to(tl.int64)
        tok_in_block = tokens % BLOCK_SIZE
        k_offs = b64 * stride_cb + tok_in_block * stride_ct + k_head_off
        v_offs = b64 * stride_vb + tok_in_block * stride_vt + v_head_off
        if V_CHANNEL_MAJOR:
            # a block's tokens of one channel are contiguous (runs of BLOCK_SIZE, or of the
            # tile when it is shorter, starting on a tile boundary): 16-byte loads
            RUN: tl.constexpr = min(BLOCK_SIZE, tokens.shape[0])
            v_offs = tl.max_contiguous(tl.multiple_of(v_offs, RUN), RUN)
        k_ptrs = k_cache_ptr + k_offs[:, None] + dims[None, :]
        vT_ptrs = v_cache_ptr + v_offs[None, :] + dims[:, None] * stride_vd
        if MASKED:
            tok_mask = tokens < end
            k = tl.load(k_ptrs, mask=tok_mask[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        # k: [BLOCK_N, HEAD_DIM]; vT: [HEAD_DIM, BLOCK_N]; sT: [BLOCK_N, GROUP_PAD]
        vT = tl.load(vT_ptrs)
        sT = tl.dot(k.to(tl.float16), qT)
        if MASKED:
            sT = tl.where(tok_mask[:, None], sT, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sT, 0) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        pT = tl.exp2(sT * qk_scale - m_new[None, :])
        l_i = l_i * alpha + tl.sum(pT, 0)
        vT = vT.to(tl.float16)
        if MASKED:
            vT = tl.where(tok_mask[None, :], vT, 0.0)
        accT = accT * alpha[None, :] + tl.dot(vT, pT.to(tl.float16))
        return m_new, l_i, accT

    @triton.jit
    def _swapped_tiles(q_row_ptr, stride_qh, k_cache_ptr, v_cache_ptr, table, start, end, heads,
                       row_mask, dims, n_offs, k_head_off, v_head_off, stride_cb, stride_ct,
                       stride_vb, stride_vt, stride_vd, qk_scale, GROUP_PAD: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                       NUM_STAGES: tl.constexpr, V_CHANNEL_MAJOR: tl.constexpr,
                       OFFS32: tl.constexpr):
        # The 8-bit cache's tiles, with the dots transposed: sT = K q^T and accT = V^T p^T, so
        # the cache's tiles are the dots' first operands, read straight from shared memory
        # into registers and converted there (e4m3/e5m2 -> fp16, one instruction per two
        # values). V^T wants each channel's tokens side by side: the engine stores an 8-bit V
        # channel-major (store_kv.channel_major), so they are contiguous. Read token-major,
        # the second dot re-laid the tile through shared memory one byte at a time (H200,
        # 16q/8kv: 226 -> 182 us at B=256 L=1024, 205 -> 181 at B=64 L=4096). Whole tiles
        # run unmasked; a partial last tile runs once after them, masked.
        # Returns m_i, l_i [GROUP_PAD] and acc [GROUP_PAD, HEAD_DIM], as the main loop's.
        # qT: [HEAD_DIM, GROUP_PAD], clamped to fp16's range (exact for a bf16 q inside it)
        qT = tl.load(q_row_ptr + heads[None, :] * stride_qh + dims[:, None],
                     mask=row_mask[None, :], other=0.0)
        qT = tl.minimum(tl.maximum(qT.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        accT = tl.zeros([HEAD_DIM, GROUP_PAD], tl.float32)
        full_end = start + (end - start) // BLOCK_N * BLOCK_N
        # the next tile's block ids are looked up one tile ahead
        blocks = tl.load(table + (start + n_offs) // BLOCK_SIZE, mask=start + n_offs < end,
                         other=0)
        for n0 in tl.range(start, full_end, BLOCK_N, num_stages=NUM_STAGES):
            tokens = n0 + n_offs
            cur = blocks
            nxt = tokens + BLOCK_N
            blocks = tl.load(table + nxt // BLOCK_SIZE, mask=nxt < end, other=0)
            m_i, l_i, accT = _swapped_tile(qT, m_i, l_i, accT, k_cache_ptr, v_cache_ptr, cur,
                                           tokens, end, dims, k_head_off, v_head_off,
                                           stride_cb, stride_ct, stride_vb, stride_vt,
                                           stride_vd, qk_scale, BLOCK_SIZE, V_CHANNEL_MAJOR,
                                           OFFS32, False)
        if full_end < end:
            m_i, l_i, accT = _swapped_tile(qT, m_i, l_i, accT, k_cache_ptr, v_cache_ptr, blocks,
                                           full_end + n_offs, end, dims, k_head_off,
                                           v_head_off, stride_cb, stride_ct, stride_vb,
                                           stride_vt, stride_vd, qk_scale, BLOCK_SIZE,
                                           V_CHANNEL_MAJOR, OFFS32, True)
        return m_i, l_i, tl.trans(accT)

    # Step-varying table pointers and ints are not specialized (16-byte alignment, multiples
    # of 16): a mixed step's slices and each step's table width would compile new variants.
    @triton.jit(do_not_specialize=["block_tables_ptr", "context_lens_ptr", "order_ptr",
                                   "stride_bt"])
    def _paged_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, order_ptr,
        out_ptr, part_out_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr,
        qk_scale,
        stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
        stride_cb, stride_ct, stride_ch, stride_vb, stride_vt, stride_vh, stride_vd,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
        NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr, DOT_PRECISION: tl.constexpr,
        IS_FP8: tl.constexpr, SWAP_AB: tl.constexpr, V_CHANNEL_MAJOR: tl.constexpr,
        OFFS32: tl.constexpr,
        HAS_ORDER: tl.constexpr,
    ):
        # One program: all GROUP query heads of one KV head of one sequence, over one KV split,
        # so every K/V tile is read once; the group is padded to GROUP_PAD (decode_group_pad).
        # IS_FP8: K/V tiles are cast up (exact) in registers; k_scale folds into the softmax
        # scale and v_scale into the output, the same product as dequantizing. With a 16-bit
        # q (SWAP_AB) the dots run transposed in fp16, see _swapped_tiles; with an fp32 q
        # below, in fp32. V is read through its own strides (stride_vd: between channels).
        # HAS_ORDER: the sequences in launch order, longest context first, so the last
        # programs to start are short ones and no long one runs on alone at the end.
        kv_head = tl.program_id(0)
        if HAS_ORDER:
            seq = tl.load(order_ptr + tl.program_id(1))
        else:
            seq = tl.program_id(1)
        split = tl.program_id(2)
        seq64 = seq.to(tl.int64)
        context_len = tl.load(context_lens_ptr + seq)
        if SPLIT:
            # Each sequence spreads its own context over the splits, in whole tiles: a CUDA
            # graph captured for the longest context still splits a short one finely (one
            # tile a program rather than a few, and more programs busy).
            tokens_per_split = _split_tokens(context_len, tl.num_programs(2), BLOCK_N)
            start = split * tokens_per_split
            end = tl.minimum(context_len, start + tokens_per_split)
            if start >= context_len:
                return  # the merge ignores splits past the context
        else:
            start = 0
            end = context_len
        rows = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + rows
        row_mask = rows < GROUP
        if IS_FP8:
            qk_scale = qk_scale * tl.load(k_scale_ptr)
        table = block_tables_ptr + seq64 * stride_bt
        n_offs = tl.arange(0, BLOCK_N)
        if SWAP_AB:
            m_i, l_i, acc = _swapped_tiles(
                q_ptr + seq64 * stride_qb, stride_qh, k_cache_ptr, v_cache_ptr, table, start,
                end, heads, row_mask, dims, n_offs, kv_head * stride_ch, kv_head * stride_vh,
                stride_cb, stride_ct, stride_vb, stride_vt, stride_vd, qk_scale, GROUP_PAD,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, NUM_STAGES, V_CHANNEL_MAJOR, OFFS32)
        else:
            # q: [GROUP_PAD, HEAD_DIM]
            q = tl.load(
                q_ptr + seq64 * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0,
            )
            m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([GROUP_PAD], tl.float32)
            acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
            # PREFETCH: look the next tile's block ids up one tile ahead, so a tile's K/V
            # loads do not wait on their own table lookup.
            blocks = tl.load(table + (start + n_offs) // BLOCK_SIZE, mask=start + n_offs < end,
                             other=0)
            for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
                tokens = n0 + n_offs
                tok_mask = tokens < end
                if not PREFETCH:
                    blocks = tl.load(table + tokens // BLOCK_SIZE, mask=tok_mask, other=0)
                tok_in_block = tokens % BLOCK_SIZE
                k_offs = blocks.to(tl.int64) * stride_cb + tok_in_block * stride_ct
                v_offs = blocks.to(tl.int64) * stride_vb + tok_in_block * stride_vt
                if PREFETCH:
                    nxt = tokens + BLOCK_N
                    blocks = tl.load(table + nxt // BLOCK_SIZE, mask=nxt < end, other=0)
                # k, v: [BLOCK_N, HEAD_DIM]
                k = tl.load(k_cache_ptr + kv_head * stride_ch + k_offs[:, None] + dims[None, :],
                            mask=tok_mask[:, None], other=0.0)
                v = tl.load(v_cache_ptr + kv_head * stride_vh + v_offs[:, None]
                            + dims[None, :] * stride_vd, mask=tok_mask[:, None], other=0.0)
                if IS_FP8:  # with an fp32 q: exact casts, fp32 dots
                    k = k.to(q.dtype)
                    v = v.to(q.dtype)
                # s: [GROUP_PAD, BLOCK_N]; scores in log2 units
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
                s = tl.where(tok_mask[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s * qk_scale - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                                    input_precision=DOT_PRECISION)
                m_i = m_new
        # An empty context leaves l_i = 0: write zeros, not NaN.
        safe_l = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / safe_l[:, None]
        if IS_FP8:
            out = out * tl.load(v_scale_ptr)
        if SPLIT:
            # part_out: [batch, num_heads, splits, HEAD_DIM]; part_lse: [batch, num_heads, splits]
            num_splits = tl.num_programs(2)
            part = (seq64 * tl.num_programs(0) * GROUP + heads) * num_splits + split
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out,
                     mask=row_mask[:, None])
            tl.store(part_lse_ptr + part, m_i + tl.log2(safe_l), mask=row_mask)
        else:
            tl.store(out_ptr + seq64 * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])

    @triton.jit(do_not_specialize=["context_lens_ptr", "num_splits"])
    def _merge_splits_kernel(
        out_ptr, part_out_ptr, part_lse_ptr, context_lens_ptr,
        num_splits, stride_ob, stride_oh,
        HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # One program merges one (sequence, head) over its splits by log-sum-exp, in fp32.
        head = tl.program_id(0)
        seq = tl.program_id(1)
        context_len = tl.load(context_lens_ptr + seq)
        splits = tl.arange(0, SPLITS_PAD)
        dims = tl.arange(0, HEAD_DIM)
        tokens_per_split = _split_tokens(context_len, num_splits, BLOCK_N)
        valid = (splits < num_splits) & (splits * tokens_per_split < context_len)
        part = (seq.to(tl.int64) * tl.num_programs(0) + head) * num_splits + splits
        lse = tl.load(part_lse_ptr + part, mask=valid, other=float("-inf"))
        lse_max = tl.max(lse, 0)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        w = tl.exp2(lse - lse_max)
        o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None],
                    other=0.0)
        w_sum = tl.sum(w, 0)
        out = tl.sum(o * w[:, None], 0) / tl.where(w_sum > 0.0, w_sum, 1.0)
        tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + dims,
                 out.to(out_ptr.dtype.element_ty))


def longest_first(context_lens: np.ndarray) -> np.ndarray:
    """The order for paged_decode's programs: rows by context length, longest first (ties in
    row order), [batch] int32. Started in this order, a ragged batch's programs end together:
    on an H200, 256 sequences of 100-1,700 tokens took 249 -> 233 us, 128 of 600-2,000
    189 -> 173 us (uniform lengths unchanged)."""
    return np.argsort(-context_lens.astype(np.int64), kind="stable").astype(np.int32)


def decode_config(
    head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for the decode kernel (swept on an H200, D=128: bf16
    KV; 8-bit KV with a 16-bit q, whose transposed dots took 181-183 us at B=256 L=1024 and
    B=64 L=4096 in 64-token tiles, two warps and three stages, 179-190 us with 128-token tiles
    or one warp, 197-298 with four or eight warps)."""
    if kv_dtype is not None and is_fp8(kv_dtype) and dtype != torch.float32:
        return max(16, min(64, 16384 // head_dim)), 2, 3
    tile_bytes = head_dim * dtype.itemsize
    block_n = max(16, min(64, 16384 // tile_bytes))
    return block_n, 4, 2


def fits_int32_offsets(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether every element offset into both caches (views of one layer) fits in int32."""
    return all(x.numel() <= 2**31 - 1 for x in (k_cache, v_cache))


def decode_group_pad(group: int) -> int:
    """The dot side a KV head's query group is padded to by default: at least 16 (the rows of
    q K^T; the columns of K q^T on the transposed 8-bit path, where paged_decode_launch also
    takes 8, one mma.sync tile's width: compiled offline for sm_90 (Triton 3.6, group 2,
    64-token tiles, two warps) its loop issues 521 instructions a tile with 168 registers,
    against 744 with 208 at 16; timed on an H200, within 3% of 16: see paged_decode_launch)."""
    return max(16, triton.next_power_of_2(group))


# The most splits choose_num_splits picks (compile_merge_variants compiles up to it).
MAX_SPLITS = 64


def choose_num_splits(
    batch: int, num_kv_heads: int, max_context_len: int, block_n: int, sms: int
) -> int:
    """Split-KV count from host ints only: split when there are fewer programs than SMs (to
    ~2 per SM, and no more than 4 tiles each), in three or two when there are fewer than 1.5
    or 2.5 per SM, or when contexts pass 32k; at least one tile per split, at most 64 splits.
    A CUDA graph captures this with max_context_len = the longest a sequence may grow: at small
    batches a short context still spreads over several programs (splits past a context's end
    return at once).

    The middle band, H200, 16q/8kv heads, contexts of 100-4,000 tokens: with one or two
    programs per SM each program's loads cannot cover HBM's latency. 17-40 sequences of
    900-2,000 tokens took 57-72 us unsplit, 39-64 us in two (17-24: 32-42 us in three or four);
    of 100-700 tokens the same or up to 20% less; at 64 sequences splitting lost up to 7% on
    short contexts (300-700 tokens), so 2.5 per SM ends the band."""
    programs = batch * num_kv_heads
    max_tiles = max(1, -(-max_context_len // block_n))
    splits = 1
    if programs < sms:
        # ~2 programs per SM, and no split longer than 4 tiles
        splits = max(-(-2 * sms // programs), -(-max_tiles // 4))
    elif 2 * programs < 3 * sms:
        splits = 3
    elif 2 * programs < 5 * sms:
        splits = 2
    splits = max(splits, -(-max_context_len // 32768))  # long contexts: bound one program's work
    return max(1, min(splits, max_tiles, MAX_SPLITS))


def compile_merge_variants(
    num_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype,
    device: torch.device,
) -> None:  # fmt: skip
    """Compile the split merge for each split count choose_num_splits can pick (SPLITS_PAD 2
    to 64) now: a mixed step's batch and context pick their own, and one first picked inside a
    run compiled there (bench.py --sampling reported it in a timed run)."""
    block_n = decode_config(head_dim, dtype, kv_dtype)[0]
    out = torch.empty(1, num_heads, head_dim, dtype=dtype, device=device)
    context_lens = torch.ones(1, dtype=torch.int32, device=device)
    pad = 2
    while pad <= triton.next_power_of_2(MAX_SPLITS):
        part_out = torch.zeros(1, num_heads, pad, head_dim, dtype=torch.float32, device=device)
        part_lse = torch.zeros(1, num_heads, pad, dtype=torch.float32, device=device)
        _merge_splits_kernel[(num_heads, 1)](
            out, part_out, part_lse, context_lens, pad, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, SPLITS_PAD=pad, BLOCK_N=block_n, num_warps=4,
        )  # fmt: skip
        pad *= 2


def paged_decode_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    prefetch: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
    group_pad: int | None = None,
    offsets32: bool = False,
) -> torch.Tensor:
    """paged_decode with every launch choice explicit (tests and the benchmark sweep use it).
    group_pad: the dot side the query group is padded to (default decode_group_pad's).
    offsets32: the transposed 8-bit path computes its cache addresses in 32 bits (ValueError
    unless every offset into k_cache and v_cache fits: fits_int32_offsets). Compiled offline
    for sm_90 (Triton 3.6) with group_pad 8, its loop issues 441 instructions a 64-token tile
    with 159 registers, against 521 and 168 in 64 bits. Timed on an H200 (kernel_bench.py
    --sweep --only decode, 2026-11-27), neither is the default: at B=256 L=1024 and B=64
    L=4096 the default launch took 183 us, group_pad 8 with offsets32 178 us with one warp
    and 187 us with two, group_pad 8 alone 190 us; at B=8 L=8192, 65-67 us against 70."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = new_output(q, out)
    if batch == 0:
        return out
    split = num_splits > 1
    if split:
        part_out = torch.empty(batch, num_heads, num_splits, head_dim, device=q.device,
                               dtype=torch.float32)
        part_lse = torch.empty(batch, num_heads, num_splits, device=q.device,
                               dtype=torch.float32)
    else:
        part_out = part_lse = out
    grid = (num_kv_heads, batch, num_splits)
    fp8 = is_fp8(k_cache.dtype)
    if fp8 and q.dtype != torch.float32 and num_warps > 2:
        # Four warps make Triton 3.6 use wgmma here; in two stages its partial last tile
        # came out wrong on an H200 (and read out of bounds). mma.sync, 1-2 warps, is right.
        raise ValueError(f"num_warps must be 1 or 2 for an 8-bit cache with a 16-bit q, "
                         f"got {num_warps}")
    swap_ab = fp8 and q.dtype != torch.float32
    if group_pad is None:
        group_pad = decode_group_pad(group)
    if offsets32 and not fits_int32_offsets(k_cache, v_cache):
        raise ValueError("offsets32 needs caches whose every offset fits in int32, got "
                         f"{k_cache.numel()} elements")
    if group_pad < max(8 if swap_ab else 16, group) or group_pad & (group_pad - 1):
        raise ValueError(f"group_pad must be a power of two >= the query group ({group}) and "
                         f">= {8 if swap_ab else 16}, got {group_pad}")
    _paged_decode_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens,
        context_lens if order is None else order, out, part_out, part_lse,
        k_scale, v_scale, scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *v_cache.stride(),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=split, NUM_STAGES=num_stages,
        PREFETCH=prefetch, DOT_PRECISION=dot_precision(q.dtype), IS_FP8=fp8,
        SWAP_AB=swap_ab, V_CHANNEL_MAJOR=v_cache.stride(1) == 1, OFFS32=offsets32,
        HAS_ORDER=order is not None, num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        _merge_splits_kernel[(num_heads, batch)](
            out, part_out, part_lse, context_lens, num_splits,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(num_splits), BLOCK_N=block_n,
            num_warps=4,
        )
    return out


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over paged K/V; q: [batch, num_heads, head_dim] -> same shape and dtype.

    head_dim: a power of two in [16, 256] (ValueError otherwise); block_size: a power of two
    >= 8; fp16/bf16/fp32 (fp32 exact, no TF32). No host sync: the split-KV count comes from
    max_context_len (an upper bound on every context_len) or else the block-table width, so
    the call can be captured in a CUDA graph. An empty context yields zeros. An fp8 cache
    (e4m3 or e5m2) is dequantized in registers with k_scale / v_scale ([1] fp32 on the device,
    read by the kernel, so graphs see later changes). out: where to write (q's shape and
    dtype, rows of head_dim contiguous), e.g. a slice of a mixed step's output. order: a
    permutation of the rows ([batch] int32, e.g. longest_first's), the order the sequences'
    programs start in; the output is the same.
    """
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    block_n, num_warps, num_stages = decode_config(head_dim, q.dtype, k_cache.dtype)
    num_splits = choose_num_splits(batch, num_kv_heads, max_context_len, block_n,
                                   num_sms(q.device))
    return paged_decode_launch(q, k_cache, v_cache, block_tables, context_lens, scale,
                               num_splits, block_n, num_warps, num_stages,
                               k_scale=k_scale, v_scale=v_scale, out=out, order=order)
