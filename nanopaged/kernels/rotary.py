"""Rotate-half RoPE on q and k, optionally after Qwen3's per-head q/k RMSNorm, in one kernel."""

from __future__ import annotations

import torch

from nanopaged.kernels.rms_norm import rms_norm_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use rotary_ref / qk_norm_rotary_ref
    triton = None

# (v, k_cache, v_cache, slot_mapping): where the rotary kernel also stores this step's K/V
KVStore = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def rotary_tables_ref(
    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin table rows at positions, cast to dtype: [num_tokens, 1, head_dim] each, the
    sin row's first half negated (rotate_half's sign moved into the table, see rotate_ref)."""
    cos_t = cos.index_select(0, positions).to(dtype)
    sin_t = sin.index_select(0, positions).to(dtype)  # index_select made a copy: negate in place
    sin_t[:, : sin_t.shape[-1] // 2].neg_()
    return cos_t.unsqueeze(1), sin_t.unsqueeze(1)


def rotate_ref(x: torch.Tensor, cos_t: torch.Tensor, signed_sin_t: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], in x's dtype (each product and
    the sum rounded, as torch rounds them). x: [num_tokens, heads, head_dim]; the tables from
    rotary_tables_ref. [x2, x1] times the signed sin gives rotate_half(x) * sin bit for bit
    (-a * b == a * -b): one roll instead of a split, a negation and a concatenation."""
    out = x * cos_t
    out += x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin_t)
    return out


def rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: x * cos + rotate_half(x) * sin with the tables cast to x's dtype."""
    # q: [num_tokens, num_heads, head_dim]; cos_t, sin_t: [num_tokens, 1, head_dim]
    cos_t, sin_t = rotary_tables_ref(cos, sin, positions, q.dtype)
    return rotate_ref(q, cos_t, sin_t), rotate_ref(k, cos_t, sin_t)


def qk_norm_rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: RMSNorm of every q and k head over head_dim, then rotary_ref."""
    q = rms_norm_ref(q, q_weight, eps)
    k = rms_norm_ref(k, k_weight, eps)
    return rotary_ref(q, k, cos, sin, positions)


if triton is not None:

    @triton.jit
    def _load_heads(x_ptr, stride_h, num_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_HALF: tl.constexpr):
        # One token's heads from x_ptr (its first head), each row split into halves x1 | x2.
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (h < num_heads) & (d < HALF)
        x1 = tl.load(x_ptr + h * stride_h + d, mask=mask, other=0.0)
        x2 = tl.load(x_ptr + h * stride_h + HALF + d, mask=mask, other=0.0)
        return x1, x2

    @triton.jit
    def _rotate_heads(
        x1, x2, out_ptr, w1, w2, stride_oh, num_heads,
        c1, s1, c2, s2, inv_head_dim, eps,
        HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
        APPLY_NORM: tl.constexpr,
    ):
        # x1 | x2: the halves of one token's heads (from _load_heads); out_ptr: its first head;
        # w1 | w2: the norm weight's halves in fp32 (unread without APPLY_NORM).
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (h < num_heads) & (d < HALF)
        dtype = x1.dtype
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        if APPLY_NORM:
            mean_sq = (tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) * inv_head_dim
            rstd = tl.rsqrt(mean_sq + eps)[:, None]
            # Same roundings as torch: normed to x's dtype, times weight rounded again.
            f1 = ((f1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
            f2 = ((f2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        # torch rounds each product and the sum to x's dtype; so do we (no FMA, see launcher).
        o1 = (f1 * c1).to(dtype).to(tl.float32) - (f2 * s1).to(dtype).to(tl.float32)
        o2 = (f2 * c2).to(dtype).to(tl.float32) + (f1 * s2).to(dtype).to(tl.float32)
        tl.store(out_ptr + h * stride_oh + d, o1.to(dtype), mask=mask)
        tl.store(out_ptr + h * stride_oh + HALF + d, o2.to(dtype), mask=mask)
        return o1.to(dtype), o2.to(dtype)

    @triton.jit
    def _rotary_kernel(
        q_ptr, k_ptr, q_out_ptr, k_out_ptr, q_weight_ptr, k_weight_ptr,
        cos_ptr, sin_ptr, positions_ptr, num_heads, num_kv_heads, inv_head_dim, eps,
        stride_qt, stride_qh, stride_kt, stride_kh,
        stride_oqt, stride_oqh, stride_okt, stride_okh, stride_cos, stride_sin,
        v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stride_vt, stride_vh,
        HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV_H: tl.constexpr,
        BLOCK_HALF: tl.constexpr, APPLY_NORM: tl.constexpr, STORE_KV: tl.constexpr,
    ):
        # One program rotates every q and k head of one token: the cos/sin row is read once.
        # Every load this token needs is issued before the first store: at one token per step
        # the kernel is a chain of memory round trips, and a store ahead of a load would order
        # them (the pointers may alias), so the latencies overlap instead of adding up.
        token = tl.program_id(0).to(tl.int64)
        pos = tl.load(positions_ptr + token).to(tl.int64)
        q1, q2 = _load_heads(q_ptr + token * stride_qt, stride_qh, num_heads, HALF, BLOCK_H,
                             BLOCK_HALF)
        k1, k2 = _load_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, HALF,
                             BLOCK_KV_H, BLOCK_HALF)
        if STORE_KV:
            slot = tl.load(slot_mapping_ptr + token)
            v1, v2 = _load_heads(v_ptr + token * stride_vt, stride_vh, num_kv_heads, HALF,
                                 BLOCK_KV_H, BLOCK_HALF)
        d = tl.arange(0, BLOCK_HALF)[None, :]
        dmask = d < HALF
        dtype = q_ptr.dtype.element_ty
        # The tables are cast to x's dtype first, as the torch module does.
        cos_row = cos_ptr + pos * stride_cos
        sin_row = sin_ptr + pos * stride_sin
        c1 = tl.load(cos_row + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)
        c2 = tl.load(cos_row + HALF + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)
        s1 = tl.load(sin_row + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)
        s2 = tl.load(sin_row + HALF + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)
        qw1, qw2, kw1, kw2 = c1, c1, c1, c1
        if APPLY_NORM:
            qw1 = tl.load(q_weight_ptr + d, mask=dmask, other=0.0).to(tl.float32)
            qw2 = tl.load(q_weight_ptr + HALF + d, mask=dmask, other=0.0).to(tl.float32)
            kw1 = tl.load(k_weight_ptr + d, mask=dmask, other=0.0).to(tl.float32)
            kw2 = tl.load(k_weight_ptr + HALF + d, mask=dmask, other=0.0).to(tl.float32)
        _rotate_heads(
            q1, q2, q_out_ptr + token * stride_oqt, qw1, qw2,
            stride_oqh, num_heads, c1, s1, c2, s2, inv_head_dim, eps,
            HALF, BLOCK_H, BLOCK_HALF, APPLY_NORM,
        )
        k1, k2 = _rotate_heads(
            k1, k2, k_out_ptr + token * stride_okt, kw1, kw2,
            stride_okh, num_kv_heads, c1, s1, c2, s2, inv_head_dim, eps,
            HALF, BLOCK_KV_H, BLOCK_HALF, APPLY_NORM,
        )
        if STORE_KV:
            # store_kv's job for this token, while its rotated k is in registers: k and v
            # into the cache slot (one row of num_kv_heads * head_dim), slot -1 skipped.
            if slot >= 0:
                h = tl.arange(0, BLOCK_KV_H)[:, None]
                mask = (h < num_kv_heads) & dmask
                row = slot * num_kv_heads * (2 * HALF) + h * (2 * HALF)
                tl.store(k_cache_ptr + row + d, k1, mask=mask)
                tl.store(k_cache_ptr + row + HALF + d, k2, mask=mask)
                tl.store(v_cache_ptr + row + d, v1, mask=mask)
                tl.store(v_cache_ptr + row + HALF + d, v2, mask=mask)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    assert triton is not None, "rotary kernels need triton; use rotary_ref"
    assert q.dim() == 3 and k.dim() == 3, (q.shape, k.shape)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim), (q.shape, k.shape)
    assert head_dim % 2 == 0, head_dim
    assert q.stride(2) == 1 and k.stride(2) == 1, (q.stride(), k.stride())
    assert q.dtype == k.dtype and q.device == k.device
    assert cos.dim() == 2 and cos.shape == sin.shape and cos.shape[1] == head_dim, cos.shape
    assert cos.stride(1) == 1 and sin.stride(1) == 1
    assert cos.device == q.device and sin.device == q.device
    assert positions.shape == (num_tokens,), positions.shape
    assert positions.dtype in (torch.int32, torch.int64) and positions.device == q.device
    apply_norm = q_weight is not None
    if apply_norm:
        assert q_weight.shape == (head_dim,) and k_weight.shape == (head_dim,)
        assert q_weight.is_contiguous() and k_weight.is_contiguous()
        assert q_weight.dtype == q.dtype and k_weight.dtype == q.dtype, q_weight.dtype
    else:
        q_weight = k_weight = q  # unread placeholders
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if store is not None:
        v, k_cache, v_cache, slots = store
        assert v.shape == k.shape and v.stride(2) == 1 and v.dtype == k.dtype, v.shape
        assert k_cache.dtype == v_cache.dtype == k.dtype, (k_cache.dtype, k.dtype)
        assert k_cache.shape == v_cache.shape and k_cache.shape[-2:] == k.shape[1:]
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        assert slots.shape == (num_tokens,) and slots.dtype == torch.int64, slots.shape
        assert k_cache.device == v.device == slots.device == q.device
        store_args = (v, k_cache, v_cache, slots, v.stride(0), v.stride(1))
    else:
        store_args = (q, q, q, positions, 0, 0)  # unread placeholders
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, q_weight, k_weight,
        cos, sin, positions, num_heads, num_kv_heads, 1.0 / head_dim, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), sin.stride(0), *store_args,
        HALF=half, BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half), APPLY_NORM=apply_norm,
        STORE_KV=store is not None,
        num_warps=4,
        # Contracting x * cos + r * sin into an FMA would skip torch's fp32 product rounding.
        enable_fp_fusion=False,
    )
    return q_out, k_out


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim].

    q/k may be strided views (e.g. of a packed qkv output) with head_dim innermost; cos/sin are
    [max_position, head_dim] tables. Returns new contiguous tensors; q and k are not modified.
    store: (v, k_cache, v_cache, slot_mapping) also writes the rotated k and v into the caches
    at slot_mapping (-1 skips), as store_kv_ref would: one kernel instead of two (caches of
    q's dtype only, not 8-bit ones).
    """
    return _launch(q, k, None, None, 0.0, cos, sin, positions, store)


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q and k (weights [head_dim]) then RoPE, in one kernel.

    Same layouts, store and return convention as apply_rotary.
    """
    return _launch(q, k, q_weight, k_weight, eps, cos, sin, positions, store)
