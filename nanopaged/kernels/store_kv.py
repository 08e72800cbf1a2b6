"""Write this step's K/V into the paged cache at slot_mapping (quantized for an 8-bit cache)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use store_kv_ref
    triton = None

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a KV cache of this dtype holds 8-bit values with per-layer scales."""
    return dtype in FP8_DTYPES


def channel_major(v_cache: torch.Tensor) -> torch.Tensor:
    """The engine's 8-bit V cache layout over the memory of a contiguous v_cache: the same
    [num_blocks, block_size, num_kv_heads, head_dim] indexing, laid out
    [num_blocks, num_kv_heads, head_dim, block_size], so a block's tokens of one channel are
    contiguous, the order the decode kernel's second dot reads (see paged_decode's
    _swapped_tiles). A view: the bytes are reinterpreted, not moved (bind it to a fresh cache,
    or copy values in)."""
    num_blocks, block_size, num_kv_heads, head_dim = v_cache.shape
    assert v_cache.is_contiguous(), v_cache.stride()
    return v_cache.view(num_blocks, num_kv_heads, head_dim, block_size).permute(0, 3, 1, 2)


def v_layout_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether v_cache is laid out as the contiguous k_cache or channel_major (the layouts
    the kernels take); from the strides alone, as the launchers check it on every call."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    row = block_size * num_kv_heads * head_dim
    return v_cache.stride() in (k_cache.stride(), (row, 1, head_dim * block_size, block_size))


# calibrated_scale maps this many times a tensor's largest |value| to the format's largest:
# room for K/V larger than those of the pass that set the scale.
KV_SCALE_HEADROOM = 2.0


def calibrated_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The [1] fp32 scale for storing x in the 8-bit dtype with KV_SCALE_HEADROOM: largest
    |x| * headroom / the format's largest value; 1.0 when x holds no nonzero finite value.
    On x's device, with no host sync."""
    if x.numel() == 0:
        return torch.ones(1, dtype=torch.float32, device=x.device)
    amax = x.detach().abs().amax().float().reshape(1)
    scale = amax * (KV_SCALE_HEADROOM / torch.finfo(dtype).max)
    return torch.where((amax > 0) & torch.isfinite(amax), scale, torch.ones_like(scale))


def quantize_ref(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale, clamped to dtype's finite range, cast to the 8-bit dtype; scale: [1] fp32."""
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    may_skip: bool = True,
) -> None:
    """Torch reference: key/value [N, num_kv_heads, head_dim] into the caches (-1 skips).

    An fp8 cache stores key / k_scale and value / v_scale ([1] fp32 tensors), clamped.
    may_skip=False: the caller knows no slot is -1, so the check (a read back of the slots,
    once per layer on CPU) is left out.
    """
    # k_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    #       -> [num_slots, num_kv_heads, head_dim]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    slots = slot_mapping.long()
    if may_skip and bool((slots < 0).any()):
        keep = torch.nonzero(slots >= 0).flatten()
        slots, key, value = slots[keep], key[keep], value[keep]
    if is_fp8(k_cache.dtype):
        assert k_scale is not None and v_scale is not None, "an fp8 cache needs its scales"
        key = quantize_ref(key, k_scale, k_cache.dtype)
        value = quantize_ref(value, v_scale, v_cache.dtype)
        # CPU torch has no fp8 index_copy_: move the bytes.
        key, value = key.view(torch.uint8), value.view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    # index_copy_, not boolean-mask assignment: on CPU that threads its loop over the whole
    # cache and costs milliseconds per call at 2 threads.
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
    if v_cache.is_contiguous():
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))
    else:  # channel_major: each slot's [num_kv_heads, head_dim] is strided
        block_size = v_cache.shape[1]
        v_cache[slots // block_size, slots % block_size] = value.to(v_cache.dtype)


if triton is not None:

    @triton.jit
    def _store_kv_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
        k_out_ptr, v_out_ptr,
        stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd,
        stride_cvb, stride_cvt, stride_cvh, stride_cvd, block_size,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8_MAX: tl.constexpr,
        WRITE_OUT: tl.constexpr,
    ):
        # One program writes every head of one token. FP8_MAX > 0: quantize (exact division,
        # as the reference, so both round to the same 8-bit value). The K cache is
        # contiguous; the V cache's strides are stride_cv* (channel_major for 8 bits).
        # WRITE_OUT: the stored values, cast back, also go to k_out/v_out (packed
        # [N, NUM_KV_HEADS, HEAD_DIM]), for every token, slot -1 included.
        token = tl.program_id(0)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if not WRITE_OUT:
            if slot < 0:
                return
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
        token64 = token.to(tl.int64)
        k = tl.load(key_ptr + token64 * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
        v = tl.load(value_ptr + token64 * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
        if FP8_MAX > 0:
            # div_rn does not broadcast: give it the scale as a full tile.
            tile = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
            k = tl.div_rn(k.to(tl.float32), tile + tl.load(k_scale_ptr))
            v = tl.div_rn(v.to(tl.float32), tile + tl.load(v_scale_ptr))
            k = tl.clamp(k, -FP8_MAX, FP8_MAX)
            v = tl.clamp(v, -FP8_MAX, FP8_MAX)
        k = k.to(k_cache_ptr.dtype.element_ty)
        v = v.to(v_cache_ptr.dtype.element_ty)
        if WRITE_OUT:
            out = token64 * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM + d
            tl.store(k_out_ptr + out, k.to(tl.float32).to(k_out_ptr.dtype.element_ty), mask=mask)
            tl.store(v_out_ptr + out, v.to(tl.float32).to(v_out_ptr.dtype.element_ty), mask=mask)
            mask = mask & (tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot >= 0)
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM + d
        v_dst = ((slot // block_size) * stride_cvb + (slot % block_size) * stride_cvt
                 + h * stride_cvh + d * stride_cvd)
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + v_dst, v, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
) -> None:
    """Scatter key/value [N, num_kv_heads, head_dim] (any strides) into the caches; -1 skips.

    An fp8 cache takes its [1] fp32 scales: it stores clamp(x / scale) in 8 bits. The caches
    are contiguous, or v_cache is channel_major (as the engine keeps an 8-bit V). k_out /
    v_out (contiguous, key's shape): also receive the values stored, cast to their dtype
    (exact for an 8-bit cache and a 16-bit or fp32 out), every token's row, -1 included:
    what paged_prefill takes as this step's K/V over an 8-bit cache.
    """
    assert triton is not None, "store_kv needs triton; use store_kv_ref"
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, (value.shape, key.shape)
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim), k_cache.shape
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
    assert k_cache.is_contiguous()
    assert v_layout_ok(k_cache, v_cache), v_cache.stride()
    assert slot_mapping.shape == (num_tokens,), slot_mapping.shape
    assert slot_mapping.dtype in (torch.int32, torch.int64), slot_mapping.dtype
    assert key.device == k_cache.device == slot_mapping.device
    fp8_max = 0.0
    if is_fp8(k_cache.dtype):
        assert k_scale is not None and v_scale is not None, "an fp8 cache needs its scales"
        assert k_scale.dtype == v_scale.dtype == torch.float32, (k_scale.dtype, v_scale.dtype)
        assert k_scale.device == v_scale.device == k_cache.device
        fp8_max = torch.finfo(k_cache.dtype).max
    write_out = k_out is not None
    if write_out:
        assert v_out is not None and k_out.shape == v_out.shape == key.shape, key.shape
        assert k_out.is_contiguous() and v_out.is_contiguous()
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_out, v_out,
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), *v_cache.stride(), v_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_MAX=fp8_max, WRITE_OUT=write_out, num_warps=4,
    )
