"""Prefill attention: varlen causal queries over their paged K/V, cached prefix included."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nanopaged.kernels.paged_decode import check_paged_inputs, dot_precision, gather_kv, new_output
from nanopaged.kernels.store_kv import is_fp8

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use paged_prefill_ref
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a triton without TMA descriptors reads all K/V through the block table
    TensorDescriptor = None


def paged_prefill_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference. q: [num_tokens, num_heads, head_dim] -> same shape.

    Sequence i owns queries cu_seqlens_q[i]:cu_seqlens_q[i+1]; they are its last tokens, so
    query j sits at position context_lens[i] - q_len + j and sees keys 0..that position.
    Also the CPU path: per sequence, one gather of its context (only slots below
    context_len, so nothing stale is read) and one fused causal SDPA call, never a full
    score matrix in memory. An fp8 cache's values are multiplied by k_scale / v_scale ([1]
    fp32) in fp32.
    """
    out = torch.empty_like(q)
    # bf16 runs torch's fused attention in bf16 (fp32 accumulation inside; several times the
    # fp32 speed on CPUs with bf16 units); other dtypes attend in fp32.
    work = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for i, context_len in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        # qs: [1, num_heads, q_len, head_dim]; k, v: [1, num_kv_heads, context_len, head_dim]
        # (4-D: torch's fused CPU attention takes nothing else, 3-D falls back to the math path)
        qs = q[start:end].to(work).transpose(0, 1)[None]
        k = gather_kv(k_cache, block_tables[i], context_len, k_scale, work).transpose(0, 1)[None]
        v = gather_kv(v_cache, block_tables[i], context_len, v_scale, work).transpose(0, 1)[None]
        # enable_gqa: the fused CPU kernel maps each query head to its KV head, no repeat copy.
        if q_len == context_len:
            o = F.scaled_dot_product_attention(
                qs, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        elif q_len == 1:
            o = F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True)
        else:
            # A cached prefix: the causal diagonal is bottom-right aligned.
            q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
            k_pos = torch.arange(context_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[start:end] = o[0].transpose(0, 1).to(q.dtype)
    return out


if triton is not None:

    @triton.jit
    def _table_lookup(table, tokens, end, BLOCK_SIZE: tl.constexpr):
        # Physical block of each token (0 past end, never read beyond the context).
        return tl.load(table + tokens // BLOCK_SIZE, mask=tokens < end, other=0)

    @triton.jit
    def _load_kv_tile(k_cache_ptr, v_cache_ptr, blocks, tokens, tok_mask, dims, head_off,
                      stride_cb, stride_ct, v_strides, BLOCK_SIZE: tl.constexpr,
                      MASKED: tl.constexpr):
        # blocks: [BLOCK_N] physical block of each token -> k, v: [BLOCK_N, HEAD_DIM]. V has
        # its own strides: v_strides = (block, token, channel, this head's offset).
        stride_vb, stride_vt, stride_vd, v_head_off = v_strides
        b64 = blocks.to(tl.int64)
        tok_in_block = tokens % BLOCK_SIZE
        offs = b64 * stride_cb + tok_in_block * stride_ct + head_off
        v_offs = b64 * stride_vb + tok_in_block * stride_vt + v_head_off
        k_ptrs = k_cache_ptr + offs[:, None] + dims[None, :]
        v_ptrs = v_cache_ptr + v_offs[:, None] + dims[None, :] * stride_vd
        if MASKED:
            k = tl.load(k_ptrs, mask=tok_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=tok_mask[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        return k, v

    @triton.jit
    def _softmax_update(q, k, v, m_i, l_i, acc, visible, qk_scale,
                        MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
        # One online-softmax step over a key tile; scores stay in log2 units, fp32. An fp8
        # tile is cast up to q's dtype (exact; a no-op otherwise).
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            # Rows past q_len may see no key at all: keep their max finite.
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _fresh_diagonal(q, m_i, l_i, acc, k_new_desc, v_new_desc, q_start, n0, col, n_offs, rows,
                        rows_end, qk_scale, PAST_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr):
        # One causal tile of this step's keys, read whole from k_new/v_new: key j (0-based in
        # the chunk) is visible to query row r when j <= r < rows_end. PAST_ROWS: the tile
        # reaches past this sequence's rows into the next sequence's (or TMA's zeros past the
        # last), whose V is zeroed: p = 0 does not cancel a NaN of another request (0 * NaN).
        tokens = n0 + n_offs
        in_rows = tokens < rows_end
        k = k_new_desc.load([q_start + n0, col])
        v = v_new_desc.load([q_start + n0, col])
        if PAST_ROWS:
            v = tl.where(in_rows[:, None], v, 0.0)
        visible = (tokens[None, :] <= rows[:, None]) & in_rows[None, :]
        return _softmax_update(q, k, v, m_i, l_i, acc, visible, qk_scale, True, DOT_PRECISION)

    @triton.jit
    def _unmasked_tiles(q, m_i, l_i, acc, table, k_cache_ptr, v_cache_ptr, full_end, n_offs,
                        dims, head_off, stride_cb, stride_ct, v_strides, qk_scale,
                        BLOCK_SIZE: tl.constexpr,
                        BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
        # Cached keys [0, full_end) that every row of the tile sees, through the block table.
        if PREFETCH == 0:
            for n0 in tl.range(0, full_end, BLOCK_N, num_stages=NUM_STAGES):
                tokens = n0 + n_offs
                blocks = _table_lookup(table, tokens, full_end, BLOCK_SIZE)
                k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, blocks, tokens, None, dims,
                                     head_off, stride_cb, stride_ct, v_strides, BLOCK_SIZE,
                                     False)
                m_i, l_i, acc = _softmax_update(q, k, v, m_i, l_i, acc, None, qk_scale, False,
                                                DOT_PRECISION)
        elif PREFETCH == 1:
            blocks = _table_lookup(table, n_offs, full_end, BLOCK_SIZE)
            for n0 in tl.range(0, full_end, BLOCK_N, num_stages=NUM_STAGES):
                tokens = n0 + n_offs
                k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, blocks, tokens, None, dims,
                                     head_off, stride_cb, stride_ct, v_strides, BLOCK_SIZE,
                                     False)
                blocks = _table_lookup(table, tokens + BLOCK_N, full_end, BLOCK_SIZE)
                m_i, l_i, acc = _softmax_update(q, k, v, m_i, l_i, acc, None, qk_scale, False,
                                                DOT_PRECISION)
        else:
            blocks = _table_lookup(table, n_offs, full_end, BLOCK_SIZE)
            blocks_next = _table_lookup(table, n_offs + BLOCK_N, full_end, BLOCK_SIZE)
            for n0 in tl.range(0, full_end, BLOCK_N, num_stages=NUM_STAGES):
                tokens = n0 + n_offs
                k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, blocks, tokens, None, dims,
                                     head_off, stride_cb, stride_ct, v_strides, BLOCK_SIZE,
                                     False)
                blocks = blocks_next
                blocks_next = _table_lookup(table, tokens + 2 * BLOCK_N, full_end, BLOCK_SIZE)
                m_i, l_i, acc = _softmax_update(q, k, v, m_i, l_i, acc, None, qk_scale, False,
                                                DOT_PRECISION)
        return m_i, l_i, acc

    # As the decode kernel: step-varying table pointers and widths are not specialized.
    @triton.jit(do_not_specialize=["block_tables_ptr", "cu_seqlens_q_ptr", "context_lens_ptr",
                                   "stride_bt"])
    def _paged_prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
        out_ptr, k_scale_ptr, v_scale_ptr, k_new_desc, v_new_desc, qk_scale,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
        stride_cb, stride_ct, stride_ch, stride_vb, stride_vt, stride_vh, stride_vd,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
        PREFETCH: tl.constexpr, PACK_GQA: tl.constexpr,
        DOT_PRECISION: tl.constexpr, IS_FP8: tl.constexpr, FRESH: tl.constexpr,
        PREFIX: tl.constexpr,
    ):
        # Grid: (head or KV head, sequence, query tile); the costliest (last) tiles launch first.
        # PACK_GQA: one program's BLOCK_M rows are (query, head) pairs of one KV head's group,
        # query-major, so each K/V tile serves the whole group.
        # IS_FP8: k_scale folds into the softmax scale, v_scale into the output.
        # FRESH: this step's own keys (positions >= prefix) come from k_new/v_new, packed like
        # q and read through TMA descriptors in whole contiguous tiles; only the cached prefix
        # goes through the block table. PREFIX=False (FRESH only): no sequence has a cached
        # prefix, so those loops are compiled out.
        seq = tl.program_id(1)
        m_block = tl.num_programs(2) - 1 - tl.program_id(2)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        if PACK_GQA:
            kv_head = tl.program_id(0)
            row0 = m_block * BLOCK_M
            if row0 >= q_len * GROUP:
                return
            packed = row0 + tl.arange(0, BLOCK_M)
            rows = packed // GROUP
            heads = kv_head * GROUP + packed % GROUP
            first_row = row0 // GROUP
            rows_end = tl.minimum((row0 + BLOCK_M - 1) // GROUP + 1, q_len)
        else:
            head = tl.program_id(0)
            kv_head = head // GROUP
            first_row = m_block * BLOCK_M
            if first_row >= q_len:
                return
            rows = first_row + tl.arange(0, BLOCK_M)
            heads = head + tl.zeros([BLOCK_M], tl.int32)
            rows_end = tl.minimum(first_row + BLOCK_M, q_len)
        context_len = tl.load(context_lens_ptr + seq)
        prefix = context_len - q_len  # cached tokens before this step's queries
        row_mask = rows < q_len
        q_pos = prefix + rows
        dims = tl.arange(0, HEAD_DIM)
        # q: [BLOCK_M, HEAD_DIM]
        q_rows = (q_start + rows).to(tl.int64)
        q_offs = q_rows * stride_qt + heads * stride_qh
        o_offs = q_rows * stride_ot + heads * stride_oh
        q = tl.load(q_ptr + q_offs[:, None] + dims[None, :], mask=row_mask[:, None], other=0.0)
        if IS_FP8:
            qk_scale = qk_scale * tl.load(k_scale_ptr)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        head_off = kv_head * stride_ch
        v_strides = (stride_vb, stride_vt, stride_vd, kv_head * stride_vh)
        n_offs = tl.arange(0, BLOCK_N)
        # Keys below the tile's first query position are visible to every row: no masks
        # (FRESH: the cached prefix's whole tiles). PREFETCH looks block ids up 1 or 2 tiles
        # ahead, so a tile's K/V loads never wait on their own table lookup (the software
        # pipeliner alone does not hide it).
        if FRESH:
            full_end = prefix // BLOCK_N * BLOCK_N
        else:
            full_end = (prefix + first_row + 1) // BLOCK_N * BLOCK_N
        if PREFIX:
            m_i, l_i, acc = _unmasked_tiles(q, m_i, l_i, acc, table, k_cache_ptr, v_cache_ptr,
                                            full_end, n_offs, dims, head_off, stride_cb,
                                            stride_ct, v_strides, qk_scale, BLOCK_SIZE, BLOCK_N,
                                            NUM_STAGES, PREFETCH, DOT_PRECISION)
        if FRESH:
            # The prefix's last partial tile (masked loads: nothing past the prefix is read),
            # then this step's keys.
            if PREFIX:
                for n0 in tl.range(full_end, prefix, BLOCK_N):
                    tokens = n0 + n_offs
                    tok_mask = tokens < prefix
                    tail_blocks = _table_lookup(table, tokens, prefix, BLOCK_SIZE)
                    k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, tail_blocks, tokens,
                                         tok_mask, dims, head_off, stride_cb, stride_ct,
                                         v_strides, BLOCK_SIZE, True)
                    visible = tok_mask[None, :] & (rows >= 0)[:, None]
                    m_i, l_i, acc = _softmax_update(q, k, v, m_i, l_i, acc, visible, qk_scale,
                                                    True, DOT_PRECISION)
            fresh_full = (first_row + 1) // BLOCK_N * BLOCK_N
            col = kv_head * HEAD_DIM
            for n0 in tl.range(0, fresh_full, BLOCK_N, num_stages=NUM_STAGES):
                k = k_new_desc.load([q_start + n0, col])
                v = v_new_desc.load([q_start + n0, col])
                m_i, l_i, acc = _softmax_update(q, k, v, m_i, l_i, acc, None, qk_scale, False,
                                                DOT_PRECISION)
            # Diagonal tiles inside the sequence's rows, then the one tile (if any) that
            # reaches past them into the next sequence's: only that one zeroes V there.
            seq_full = q_len // BLOCK_N * BLOCK_N
            for n0 in tl.range(fresh_full, tl.minimum(rows_end, seq_full), BLOCK_N):
                m_i, l_i, acc = _fresh_diagonal(q, m_i, l_i, acc, k_new_desc, v_new_desc,
                                                q_start, n0, col, n_offs, rows, rows_end,
                                                qk_scale, False, DOT_PRECISION)
            for n0 in tl.range(tl.maximum(fresh_full, seq_full), rows_end, BLOCK_N):
                m_i, l_i, acc = _fresh_diagonal(q, m_i, l_i, acc, k_new_desc, v_new_desc,
                                                q_start, n0, col, n_offs, rows, rows_end,
                                                qk_scale, True, DOT_PRECISION)
        else:
            # The diagonal: causal mask, and no read past this tile's last query position.
            kv_end = prefix + rows_end
            for n0 in tl.range(full_end, kv_end, BLOCK_N):
                tokens = n0 + n_offs
                tok_mask = tokens < kv_end
                diag_blocks = _table_lookup(table, tokens, kv_end, BLOCK_SIZE)
                k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, diag_blocks, tokens, tok_mask,
                                     dims, head_off, stride_cb, stride_ct, v_strides, BLOCK_SIZE,
                                     True)
                visible = (tokens[None, :] <= q_pos[:, None]) & tok_mask[None, :]
                m_i, l_i, acc = _softmax_update(q, k, v, m_i, l_i, acc, visible, qk_scale, True,
                                                DOT_PRECISION)
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if IS_FP8:
            out = out * tl.load(v_scale_ptr)
        tl.store(out_ptr + o_offs[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None])


def prefill_config(
    head_dim: int, dtype: torch.dtype, max_seqlen_q: int, fresh_only: bool = False
) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, prefetch, pack_gqa) for the prefill kernel.

    Swept on an H200 (bf16, D=128): short queries favour small GQA-packed tiles (more
    programs in flight), long ones 128x128 tiles. fresh_only: every key is this step's own,
    read through TMA (no cached prefix): short queries then take two stages,
    2-11% faster on 8-64 sequences of 128-512 tokens, where a prefix or the block-table path
    lost 3-13% with them.
    """
    if dtype == torch.float32:
        return (64, 32, 4, 2, 1, False) if head_dim <= 64 else (32, 32, 4, 2, 1, False)
    if head_dim > 128:
        return 64, 32, 4, 2, 1, False
    if max_seqlen_q <= 512:
        return 64, 32, 4, 2 if fresh_only else 3, 1, True
    return 128, 128, 8, 3, 1, False


def paged_prefill_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    prefetch: int = 0,
    pack_gqa: bool = False,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    has_prefix: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_prefill with every launch choice explicit (tests and the benchmark sweep use it)."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = context_lens.shape[0]
    out = new_output(q, out)
    if num_tokens == 0 or batch == 0 or max_seqlen_q == 0:
        return out
    group = num_heads // num_kv_heads
    fresh = k_new is not None and TensorDescriptor is not None
    k_desc = v_desc = None
    if fresh:
        assert v_new is not None and k_new.shape == v_new.shape == (num_tokens, num_kv_heads,
                                                                    head_dim), k_new.shape
        assert k_new.dtype == v_new.dtype == q.dtype, (k_new.dtype, q.dtype)
        k_desc, v_desc = fresh_descriptor(k_new, block_n), fresh_descriptor(v_new, block_n)
    if pack_gqa:
        grid = (num_kv_heads, batch, triton.cdiv(max_seqlen_q * group, block_m))
    else:
        grid = (num_heads, batch, triton.cdiv(max_seqlen_q, block_m))
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, k_scale, v_scale,
        k_desc, v_desc, scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *v_cache.stride(),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=num_stages, PREFETCH=prefetch,
        PACK_GQA=pack_gqa, DOT_PRECISION=dot_precision(q.dtype), IS_FP8=is_fp8(k_cache.dtype),
        FRESH=fresh, PREFIX=has_prefix or not fresh, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def fresh_descriptor(x: torch.Tensor, block_n: int) -> TensorDescriptor:
    """A TMA descriptor over this step's K or V [num_tokens, num_kv_heads, head_dim] as rows of
    num_kv_heads * head_dim, loaded in [block_n, head_dim] tiles (a view of the packed qkv
    projection is used in place when its strides allow)."""
    num_tokens, num_kv_heads, head_dim = x.shape
    size = x.element_size()
    if (x.stride(2) != 1 or x.stride(1) != head_dim or (x.stride(0) * size) % 16
            or x.data_ptr() % 16):
        x = x.contiguous()
    return TensorDescriptor(x, shape=[num_tokens, num_kv_heads * head_dim],
                            strides=[x.stride(0), 1], block_shape=[block_n, head_dim])


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    max_context_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    has_prefix: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention over paged K/V; q: [num_tokens, num_heads, head_dim] -> same.

    Sequence i's queries are its last q_len tokens (q_len may be 0 or 1). Same support as
    paged_decode: head_dim a power of two in [16, 256] (ValueError otherwise), block_size a
    power of two >= 8, fp16/bf16/fp32 (fp32 exact). max_seqlen_q bounds every q_len; the grid
    comes from host ints only. max_context_len is accepted for symmetry and unused. An fp8
    cache is dequantized in registers with k_scale / v_scale ([1] fp32 on the device).
    k_new / v_new: this step's K/V ([num_tokens, num_kv_heads, head_dim], packed like q, the
    values just stored at the last q_len positions): the kernel reads them contiguously
    instead of through the block table, the same values in the same order of keys. Over an
    8-bit cache they must be the stored 8-bit values cast to q's dtype (store_kv's k_out /
    v_out, before the scales), so prefill sees what decode sees. With them,
    has_prefix=False (no sequence has cached tokens before its queries: every context_len
    equals its q_len) compiles the prefix loops out. out: as paged_decode's.
    """
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.is_contiguous()
    assert cu_seqlens_q.shape == (context_lens.shape[0] + 1,), cu_seqlens_q.shape
    assert cu_seqlens_q.device == q.device
    fresh_only = k_new is not None and not has_prefix and TensorDescriptor is not None
    config = prefill_config(q.shape[2], q.dtype, max_seqlen_q, fresh_only)
    return paged_prefill_launch(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                scale, max_seqlen_q, *config, k_scale=k_scale, v_scale=v_scale,
                                k_new=k_new, v_new=v_new, has_prefix=has_prefix, out=out)
