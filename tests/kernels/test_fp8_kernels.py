"""The 8-bit KV cache paths: store_kv quantization, paged decode/prefill dequantization and
copy_blocks on fp8 caches, Triton against the torch references the CPU path runs."""

from __future__ import annotations

import pytest
import test_paged_decode as decode_case
import test_paged_prefill as prefill_case
import torch
from kernel_inputs import DEVICE, assert_close, make_kv_cache, step_slots
from test_store_kv import packed_qkv

from nanopaged.kernels.copy_blocks import copy_blocks, copy_blocks_ref
from nanopaged.kernels.paged_decode import (
    dequantize,
    fits_int32_offsets,
    paged_decode,
    paged_decode_launch,
    paged_decode_ref,
)
from nanopaged.kernels.paged_prefill import paged_prefill, paged_prefill_ref
from nanopaged.kernels.store_kv import (
    channel_major,
    quantize_ref,
    store_kv,
    store_kv_ref,
    v_layout_ok,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


def scales(k: float, v: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([k], device=DEVICE), torch.tensor([v], device=DEVICE))


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def fp8_cache(kv: torch.Tensor, fp8: torch.dtype, channel: bool = False) -> torch.Tensor:
    """A cache of the same shape holding kv's values in 8 bits (values up to ~4); channel:
    laid out channel_major, as the engine keeps an 8-bit V."""
    values = (kv.float() * 40).clamp(-200, 200).to(fp8)
    return as_channel_major(values) if channel else values


def as_channel_major(cache: torch.Tensor) -> torch.Tensor:
    """cache's values in a fresh channel_major cache."""
    out = channel_major(torch.empty_like(cache, memory_format=torch.contiguous_format))
    out.copy_(cache)
    assert torch.equal(as_bytes(out), as_bytes(cache)) and not out.is_contiguous()
    return out


def store_case(fp8: torch.dtype, num_tokens: int, num_kv_heads: int, head_dim: int, dtype):
    block_size, num_blocks = 16, -(-num_tokens // 16) + 3
    kv = make_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, f32).to(fp8)
    key, value = packed_qkv(num_tokens, 2 * num_kv_heads, num_kv_heads, head_dim, dtype)
    key[0, 0, :4] = torch.tensor([1e6, -1e6, 3e-7, 0.0])  # clamped, subnormal, zero
    # Distinct slots (a slot written twice in one call has no defined winner); token 0 kept.
    perm = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots = perm.clone()
    slots[torch.rand(num_tokens, device=DEVICE) < 0.25] = -1
    slots[0] = perm[0]
    k_scale, v_scale = scales(0.05, 0.003)
    out, ref = kv.clone(), kv.clone()
    # V channel-major, as the engine keeps it
    store_kv(key, value, out[0, 1], channel_major(out[1, 1]), slots, k_scale, v_scale)
    store_kv_ref(key, value, ref[0, 1], channel_major(ref[1, 1]), slots, k_scale, v_scale)
    assert torch.equal(as_bytes(out), as_bytes(ref))
    # The stored values are x / scale in 8 bits: clamped to the finite range, never inf.
    fmax = torch.finfo(fp8).max
    stored = ref[0, 1].view(-1, num_kv_heads, head_dim)[slots[0], 0, :4].float()
    assert stored.tolist()[:2] == [fmax, -fmax] and stored[3] == 0
    v_slots = channel_major(ref[1, 1]).reshape(-1, num_kv_heads, head_dim)
    back = dequantize(v_slots[slots[slots >= 0]], v_scale)
    stored_v = value[slots >= 0].float()
    rel = (back - stored_v).abs() / stored_v.abs()
    # Inside the format's range (past it values clamp), rounding is at most half a step.
    in_range = (stored_v.abs() > 0.1) & (stored_v.abs() <= v_scale * fmax)
    assert in_range.sum() > 1000
    assert rel[in_range].max() <= {E4M3: 2**-4, E5M2: 2**-3}[fp8] + 1e-6


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("channel", [False, True])
def test_store_kv_fp8_on_the_grid(fp8, channel):
    # Values x = scale * (an 8-bit value) need no rounding, so the interpreter stores them
    # right: this checks the kernel's scale, clamp and slots; rounding is checked on the GPU.
    # channel: V kept channel_major (the engine's 8-bit layout).
    kv = make_kv_cache(4, 16, 2, 64, f32).to(fp8)
    k_scale, v_scale = scales(0.25, 3.0)
    grid = (torch.randn(30, 2, 64, device=DEVICE) * 20).to(fp8).float()
    key, value = grid * k_scale, grid * v_scale
    key[0, 0, :2] = torch.tensor([1e9, -1e9])  # clamped to the format's largest finite value
    slots = torch.randperm(64, device=DEVICE)[:30]
    slots[3] = -1
    out, ref = kv.clone(), kv.clone()
    v_out, v_ref = ((channel_major(x[1, 1]) if channel else x[1, 1]) for x in (out, ref))
    # k_out / v_out: the stored values cast back, every row (slot -1's too)
    k_back, v_back = torch.full_like(key, float("nan")), torch.full_like(value, float("nan"))
    store_kv(key, value, out[0, 1], v_out, slots, k_scale, v_scale, k_out=k_back, v_out=v_back)
    store_kv_ref(key, value, ref[0, 1], v_ref, slots, k_scale, v_scale)
    assert torch.equal(as_bytes(out), as_bytes(ref))
    assert torch.equal(k_back, quantize_ref(key, k_scale, fp8).float())
    assert torch.equal(v_back, grid.to(fp8).float())
    fmax = torch.finfo(fp8).max
    assert out[0, 1].view(-1, 2, 64)[slots[0], 0, :2].float().tolist() == [fmax, -fmax]
    # Each stored V row sits at its slot in the layout's indexing, every other byte unchanged.
    stored = slots[slots >= 0]
    v_rows = v_out.reshape(-1, 2, 64)
    assert torch.equal(v_rows[stored].float(), grid[slots >= 0].to(fp8).float())
    untouched = torch.ones(64, dtype=torch.bool, device=DEVICE)
    untouched[stored] = False
    before = (channel_major(kv[1, 1]) if channel else kv[1, 1]).reshape(-1, 2, 64)
    assert torch.equal(as_bytes(v_rows[untouched]), as_bytes(before[untouched]))


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_store_kv_ref_fp8(fp8):
    # The kernel's quantization runs on the GPU only: the interpreter's fp32 -> fp8 cast
    # rounds wrongly when the mantissa carries into the exponent (31.7 -> 16, not 32).
    kv = make_kv_cache(3, 16, 2, 64, f32).to(fp8)
    x = torch.randn(20, 2, 64, device=DEVICE) * 50
    slots = torch.arange(20, device=DEVICE)
    k_scale, v_scale = scales(2.0, 0.5)
    store_kv_ref(x, x, kv[0, 0], kv[1, 0], slots, k_scale, v_scale)
    k = kv[0, 0].view(-1, 2, 64)[:20]
    assert torch.equal(as_bytes(k), as_bytes((x / 2.0).to(fp8)))
    v = kv[1, 0].view(-1, 2, 64)[:20]
    assert torch.equal(as_bytes(v), as_bytes((x / 0.5).to(fp8)))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [bf16, f16, f32])
def test_store_kv_fp8_gpu(fp8, dtype):
    store_case(fp8, 4096, 8, 128, dtype)


def fp8_decode_inputs(fp8, lens, block_size, group, head_dim, dtype, num_kv_heads, channel=True):
    q, k_cache, v_cache, tables, context_lens = decode_case.make_inputs(
        lens, block_size, group, head_dim, dtype, num_kv_heads
    )
    return q, fp8_cache(k_cache, fp8), fp8_cache(v_cache, fp8, channel), tables, context_lens


def check_decode(fp8, block_size, group, head_dim, dtype, num_kv_heads, channel=True):
    lens = decode_case.mixed_lens(block_size)
    inputs = fp8_decode_inputs(fp8, lens, block_size, group, head_dim, dtype, num_kv_heads,
                               channel)
    k_scale, v_scale = scales(0.04, 0.025)
    out = paged_decode(*inputs, 0.1, k_scale=k_scale, v_scale=v_scale)
    ref = paged_decode_ref(*inputs, 0.1, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == dtype
    assert_close(out, ref, dtype)
    # The reference equals attention over the dequantized cache in the model's dtype.
    q, k8, v8, tables, context_lens = inputs
    plain = paged_decode_ref(q.float(), dequantize(k8, k_scale), dequantize(v8, v_scale),
                             tables, context_lens, 0.1)  # fmt: skip
    assert_close(ref.float(), plain, f32 if dtype == f32 else dtype)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize(
    "block_size,group,head_dim,dtype,num_kv_heads",
    [(16, 2, 64, f32, 2), (8, 4, 128, f16, 1), (32, 1, 64, f16, 2)],
)
@pytest.mark.parametrize("channel", [True, False])
def test_decode_fp8(fp8, block_size, group, head_dim, dtype, num_kv_heads, channel):
    # channel: V channel_major (the engine's layout); else laid out as K.
    check_decode(fp8, block_size, group, head_dim, dtype, num_kv_heads, channel)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("block_n,num_splits", [(16, 1), (16, 3), (32, 7)])
@pytest.mark.parametrize("group,group_pad,offsets32",
                         [(2, None, False), (2, 8, False), (2, 8, True), (8, 8, True)])
def test_decode_fp8_tiles_and_splits(fp8, block_n, num_splits, group, group_pad, offsets32):
    # The transposed (16-bit q) path with tiles smaller than a block and split contexts: whole
    # tiles, partial last tiles and splits past a context's end; the query group padded to
    # the default 16 columns or to 8; addresses in 64 or 32 bits.
    lens = [1, 15, 16, 17, 53, 64, 100]
    inputs = fp8_decode_inputs(fp8, lens, 8, group, 64, f16, 2)
    k_scale, v_scale = scales(0.04, 0.025)
    out = paged_decode_launch(*inputs, 0.1, num_splits, block_n, 2, 2, k_scale=k_scale,
                              v_scale=v_scale, group_pad=group_pad, offsets32=offsets32)
    ref = paged_decode_ref(*inputs, 0.1, k_scale=k_scale, v_scale=v_scale)
    assert_close(out, ref, f16)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [f16, f32])
def test_decode_fp8_ignores_stale_nan(fp8, dtype):
    # Every cache byte outside the contexts is NaN: slots past a context in its last block
    # (the transposed path loads whole blocks) and every unused block (block 0 stands in
    # for positions past a table). None reaches the output.
    lens = [1, 15, 33, 70, 130]
    q, k8, v8, tables, context_lens = fp8_decode_inputs(fp8, lens, 16, 2, 64, dtype, 2)
    # Block 0 holds no context (only the tables' padding points at it): a context's block 0
    # moves to a spare block with the same contents.
    used = [tables[row, : -(-n // 16)] for row, n in enumerate(lens)]
    spare = next(b for b in range(1, k8.shape[0]) if all(b not in u for u in used))
    for entries in used:
        entries[entries == 0] = spare
    k8[spare], v8[spare] = k8[0].clone(), v8[0].clone()
    valid = torch.zeros(k8.shape[:2], dtype=torch.bool, device=DEVICE)
    for row, n in enumerate(lens):
        tokens = torch.arange(n, device=DEVICE)
        valid[tables[row, tokens // 16].long(), tokens % 16] = True
    assert not valid[0].any() and (~valid[1:]).sum() > 50
    nan = as_bytes(torch.tensor([float("nan")], device=DEVICE).to(fp8))
    for cache in (k8, v8):
        as_bytes(cache)[~valid] = nan
    assert torch.isnan(v8.float()).sum() == (~valid).sum() * v8[0, 0].numel()
    k_scale, v_scale = scales(0.04, 0.025)
    out = paged_decode(q, k8, v8, tables, context_lens, 0.1, k_scale=k_scale, v_scale=v_scale)
    ref = paged_decode_ref(q, k8, v8, tables, context_lens, 0.1, k_scale=k_scale,
                           v_scale=v_scale)
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    assert_close(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [bf16, f16, f32])
def test_decode_fp8_gpu(fp8, dtype):
    check_decode(fp8, 16, 2, 128, dtype, 8)
    check_decode(fp8, 16, 2, 128, dtype, 8, channel=False)
    check_decode(fp8, 32, 4, 64, dtype, 2)
    # A long context: split-KV with the scales applied per split.
    inputs = fp8_decode_inputs(fp8, [5000, 37], 16, 2, 128, dtype, 8)
    k_scale, v_scale = scales(0.04, 0.025)
    out = paged_decode(*inputs, 0.1, k_scale=k_scale, v_scale=v_scale)
    ref = paged_decode_ref(*inputs, 0.1, k_scale=k_scale, v_scale=v_scale)
    assert_close(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n,num_warps,block_size",
                         [(32, 1, 16), (64, 1, 16), (64, 2, 16), (128, 2, 16), (32, 2, 64)])
def test_decode_fp8_launch_configs_gpu(block_n, num_warps, block_size):
    # The transposed path under the launch choices it takes (1-2 warps), two to four stages,
    # whole or split contexts: contexts with no whole tile, whole tiles only, and whole tiles
    # plus a partial last one; and tiles shorter than a block.
    lens = [1, 15, 100, 128, 129, 200, 255, 257, 300, 400]
    inputs = fp8_decode_inputs(E4M3, lens, block_size, 2, 128, bf16, 8)
    k_scale, v_scale = scales(0.04, 0.025)
    ref = paged_decode_ref(*inputs, 0.1, k_scale=k_scale, v_scale=v_scale)
    for num_stages in (2, 3, 4):
        for num_splits in (1, 3):
            for group_pad, offsets32 in ((16, False), (8, False), (8, True)):
                out = paged_decode_launch(*inputs, 0.1, num_splits, block_n, num_warps,
                                          num_stages, k_scale=k_scale, v_scale=v_scale,
                                          group_pad=group_pad, offsets32=offsets32)
                assert_close(out, ref, bf16)


@pytest.mark.parametrize("dtype,group_pad", [(f16, 4), (f16, 12), (f32, 8)])
def test_decode_refuses_bad_group_pad(dtype, group_pad):
    # The transposed path (16-bit q over an 8-bit cache) pads the group to >= 8 columns, the
    # other to >= 16 rows; powers of two only.
    inputs = fp8_decode_inputs(E4M3, [40], 16, 2, 64, dtype, 1)
    k_scale, v_scale = scales(0.04, 0.025)
    with pytest.raises(ValueError, match=rf"group_pad must be a power of two .* got {group_pad}"):
        paged_decode_launch(*inputs, 0.1, 1, 16, 2, 2, k_scale=k_scale, v_scale=v_scale,
                            group_pad=group_pad)


def test_decode_refuses_offsets32_past_int32():
    # A cache of more than 2^31 - 1 elements (meta tensors: shapes without memory).
    meta = dict(device="meta")
    q = torch.empty(1, 2, 64, dtype=f16, **meta)
    big = torch.empty(2**21 + 1, 16, 1, 64, dtype=E4M3, **meta)
    small = torch.empty(2**21 - 1, 16, 1, 64, dtype=E4M3, **meta)
    assert not fits_int32_offsets(big, big) and fits_int32_offsets(small, small)
    tables = torch.empty(1, 4, dtype=torch.int32, **meta)
    lens = torch.empty(1, dtype=torch.int32, **meta)
    one = torch.empty(1, **meta)
    with pytest.raises(ValueError, match=r"offsets32 needs caches whose every offset fits"):
        paged_decode_launch(q, big, big, tables, lens, 0.1, 1, 64, 2, 3, k_scale=one,
                            v_scale=one, offsets32=True)


def test_decode_fp8_refuses_four_warps():
    inputs = fp8_decode_inputs(E4M3, [40], 16, 2, 64, f16, 1)
    k_scale, v_scale = scales(0.04, 0.025)
    with pytest.raises(ValueError, match="num_warps must be 1 or 2"):
        paged_decode_launch(*inputs, 0.1, 1, 64, 4, 2, k_scale=k_scale, v_scale=v_scale)


def check_prefill(fp8, block_size, group, head_dim, dtype, num_kv_heads, channel=True):
    # Seeded: bf16 outputs over random e5m2 caches (values up to 5) pass the bf16 tolerance
    # in all but rare draws (one failure in ~40 on an H200).
    torch.manual_seed(0)
    inputs, max_seqlen_q = prefill_case.make_inputs(
        prefill_case.mixed_spec(block_size), block_size, group, head_dim, dtype, num_kv_heads
    )
    q, k_cache, v_cache, tables, cu, context_lens = inputs
    inputs = (q, fp8_cache(k_cache, fp8), fp8_cache(v_cache, fp8, channel), tables, cu,
              context_lens)
    k_scale, v_scale = scales(0.04, 0.025)
    out = paged_prefill(*inputs, 0.1, max_seqlen_q, k_scale=k_scale, v_scale=v_scale)
    ref = paged_prefill_ref(*inputs, 0.1, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == dtype
    assert_close(out, ref, dtype)
    plain = paged_prefill_ref(
        q.float(),
        dequantize(inputs[1], k_scale),
        dequantize(inputs[2], v_scale),
        tables,
        cu,
        context_lens,
        0.1,
    )
    assert_close(ref.float(), plain, f32 if dtype == f32 else dtype)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize(
    "block_size,group,head_dim,dtype,num_kv_heads", [(16, 2, 64, f32, 1), (8, 1, 64, f16, 2)]
)
@pytest.mark.parametrize("channel", [True, False])
def test_prefill_fp8(fp8, block_size, group, head_dim, dtype, num_kv_heads, channel):
    check_prefill(fp8, block_size, group, head_dim, dtype, num_kv_heads, channel)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [bf16, f16, f32])
def test_prefill_fp8_gpu(fp8, dtype):
    check_prefill(fp8, 16, 2, 128, dtype, 8)
    check_prefill(fp8, 16, 2, 128, dtype, 8, channel=False)
    check_prefill(fp8, 32, 4, 64, dtype, 2)


def check_prefill_fresh(fp8, dtype, spec, has_prefix=True):
    """This step's K/V given as the stored 8-bit values cast to q's dtype (what the engine
    passes), read contiguously: the cache's copies of them are NaN afterwards, so a read of
    them through the block table would show."""
    torch.manual_seed(1)
    inputs, max_q = prefill_case.make_inputs(spec, 16, 2, 64, dtype, 2)
    q, k_cache, v_cache, tables, cu, context_lens = inputs
    k8, v8 = fp8_cache(k_cache, fp8), fp8_cache(v_cache, fp8, channel=True)
    k_scale, v_scale = scales(0.04, 0.025)
    ref = paged_prefill_ref(q, k8, v8, tables, cu, context_lens, 0.1, k_scale=k_scale,
                            v_scale=v_scale)
    slots = step_slots(tables, spec, 16)
    nan = as_bytes(torch.tensor([float("nan")], device=DEVICE).to(fp8))
    news = []
    for cache in (k8, v8):
        news.append(cache[slots // 16, slots % 16].to(dtype))
        as_bytes(cache)[slots // 16, slots % 16] = nan
    assert torch.isnan(v8[slots // 16, slots % 16].float()).all()
    out = paged_prefill(q, k8, v8, tables, cu, context_lens, 0.1, max_q, k_scale=k_scale,
                        v_scale=v_scale, k_new=news[0], v_new=news[1], has_prefix=has_prefix)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [f16, f32])
def test_prefill_fp8_fresh_kv(fp8, dtype):
    check_prefill_fresh(fp8, dtype, prefill_case.mixed_spec(16))
    check_prefill_fresh(fp8, dtype, [(0, 70), (0, 5), (0, 1), (0, 33)], has_prefix=False)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_prefill_fp8_fresh_kv_gpu(fp8):
    spec = [(0, 512), (0, 300), (700, 200), (0, 1), (33, 1000)]
    check_prefill_fresh(fp8, bf16, spec)
    check_prefill_fresh(fp8, bf16, [(0, 512)] * 4 + [(0, 77)], has_prefix=False)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_copy_blocks_fp8(fp8):
    kv = make_kv_cache(10, 16, 2, 64, f32, num_layers=3).to(fp8)
    src = torch.tensor([1, 4, 7], device=DEVICE)
    dst = torch.tensor([0, 9, 2], device=DEVICE)
    out, ref = kv.clone(), kv.clone()
    copy_blocks(out, src, dst)
    copy_blocks_ref(ref, src, dst)
    assert torch.equal(as_bytes(out), as_bytes(ref))
    assert torch.equal(as_bytes(out[:, :, 9]), as_bytes(kv[:, :, 4]))


def test_v_layouts_the_kernels_take():
    kv = make_kv_cache(5, 16, 2, 64, f32).to(E4M3)
    k, v = kv[0, 0], kv[1, 0]
    assert v_layout_ok(k, v) and v_layout_ok(k, channel_major(v))
    # head-major blocks, or channels outside heads, are neither
    assert not v_layout_ok(k, v.view(5, 2, 16, 64).permute(0, 2, 1, 3))
    assert not v_layout_ok(k, v.view(5, 16, 64, 2).permute(0, 1, 3, 2))


def test_quantize_ref_clamps_to_finite():
    x = torch.tensor([1e9, -1e9, float("inf"), 1.0])
    for fp8 in (E4M3, E5M2):
        q = quantize_ref(x, torch.tensor([1.0]), fp8).float()
        fmax = torch.finfo(fp8).max
        assert q.tolist() == [fmax, -fmax, fmax, 1.0]
