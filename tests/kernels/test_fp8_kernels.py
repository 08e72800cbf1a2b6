"""The 8-bit KV cache paths: store_kv quantization, paged decode/prefill dequantization and
copy_blocks on fp8 caches, Triton against the torch references the CPU path runs."""

from __future__ import annotations

import pytest
import test_paged_decode as decode_case
import test_paged_prefill as prefill_case
import torch
from kernel_inputs import DEVICE, assert_close, make_kv_cache
from test_store_kv import packed_qkv

from nanopaged.kernels.copy_blocks import copy_blocks, copy_blocks_ref
from nanopaged.kernels.paged_decode import dequantize, paged_decode, paged_decode_ref
from nanopaged.kernels.paged_prefill import paged_prefill, paged_prefill_ref
from nanopaged.kernels.store_kv import quantize_ref, store_kv, store_kv_ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


def scales(k: float, v: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([k], device=DEVICE), torch.tensor([v], device=DEVICE))


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def fp8_cache(kv: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """A cache of the same shape holding kv's values in 8 bits (values up to ~4)."""
    return (kv.float() * 40).clamp(-200, 200).to(fp8)


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
    store_kv(key, value, out[0, 1], out[1, 1], slots, k_scale, v_scale)
    store_kv_ref(key, value, ref[0, 1], ref[1, 1], slots, k_scale, v_scale)
    assert torch.equal(as_bytes(out), as_bytes(ref))
    # The stored values are x / scale in 8 bits: clamped to the finite range, never inf.
    fmax = torch.finfo(fp8).max
    stored = ref[0, 1].view(-1, num_kv_heads, head_dim)[slots[0], 0, :4].float()
    assert stored.tolist()[:2] == [fmax, -fmax] and stored[3] == 0
    back = dequantize(ref[1, 1].view(-1, num_kv_heads, head_dim)[slots[slots >= 0]], v_scale)
    stored_v = value[slots >= 0].float()
    rel = (back - stored_v).abs() / stored_v.abs()
    # Inside the format's range (past it values clamp), rounding is at most half a step.
    in_range = (stored_v.abs() > 0.1) & (stored_v.abs() <= v_scale * fmax)
    assert in_range.sum() > 1000
    assert rel[in_range].max() <= {E4M3: 2**-4, E5M2: 2**-3}[fp8] + 1e-6


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_store_kv_fp8_on_the_grid(fp8):
    # Values x = scale * (an 8-bit value) need no rounding, so the interpreter stores them
    # right: this checks the kernel's scale, clamp and slots; rounding is checked on the GPU.
    kv = make_kv_cache(4, 16, 2, 64, f32).to(fp8)
    k_scale, v_scale = scales(0.25, 3.0)
    grid = (torch.randn(30, 2, 64, device=DEVICE) * 20).to(fp8).float()
    key, value = grid * k_scale, grid * v_scale
    key[0, 0, :2] = torch.tensor([1e9, -1e9])  # clamped to the format's largest finite value
    slots = torch.randperm(64, device=DEVICE)[:30]
    slots[3] = -1
    out, ref = kv.clone(), kv.clone()
    store_kv(key, value, out[0, 1], out[1, 1], slots, k_scale, v_scale)
    store_kv_ref(key, value, ref[0, 1], ref[1, 1], slots, k_scale, v_scale)
    assert torch.equal(as_bytes(out), as_bytes(ref))
    fmax = torch.finfo(fp8).max
    assert out[0, 1].view(-1, 2, 64)[slots[0], 0, :2].float().tolist() == [fmax, -fmax]


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


def fp8_decode_inputs(fp8, lens, block_size, group, head_dim, dtype, num_kv_heads):
    q, k_cache, v_cache, tables, context_lens = decode_case.make_inputs(
        lens, block_size, group, head_dim, dtype, num_kv_heads
    )
    return q, fp8_cache(k_cache, fp8), fp8_cache(v_cache, fp8), tables, context_lens


def check_decode(fp8, block_size, group, head_dim, dtype, num_kv_heads):
    lens = decode_case.mixed_lens(block_size)
    inputs = fp8_decode_inputs(fp8, lens, block_size, group, head_dim, dtype, num_kv_heads)
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
def test_decode_fp8(fp8, block_size, group, head_dim, dtype, num_kv_heads):
    check_decode(fp8, block_size, group, head_dim, dtype, num_kv_heads)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [bf16, f16, f32])
def test_decode_fp8_gpu(fp8, dtype):
    check_decode(fp8, 16, 2, 128, dtype, 8)
    check_decode(fp8, 32, 4, 64, dtype, 2)
    # A long context: split-KV with the scales applied per split.
    inputs = fp8_decode_inputs(fp8, [5000, 37], 16, 2, 128, dtype, 8)
    k_scale, v_scale = scales(0.04, 0.025)
    out = paged_decode(*inputs, 0.1, k_scale=k_scale, v_scale=v_scale)
    ref = paged_decode_ref(*inputs, 0.1, k_scale=k_scale, v_scale=v_scale)
    assert_close(out, ref, dtype)


def check_prefill(fp8, block_size, group, head_dim, dtype, num_kv_heads):
    inputs, max_seqlen_q = prefill_case.make_inputs(
        prefill_case.mixed_spec(block_size), block_size, group, head_dim, dtype, num_kv_heads
    )
    q, k_cache, v_cache, tables, cu, context_lens = inputs
    inputs = (q, fp8_cache(k_cache, fp8), fp8_cache(v_cache, fp8), tables, cu, context_lens)
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
def test_prefill_fp8(fp8, block_size, group, head_dim, dtype, num_kv_heads):
    check_prefill(fp8, block_size, group, head_dim, dtype, num_kv_heads)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [bf16, f16, f32])
def test_prefill_fp8_gpu(fp8, dtype):
    check_prefill(fp8, 16, 2, 128, dtype, 8)
    check_prefill(fp8, 32, 4, 64, dtype, 2)


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


def test_quantize_ref_clamps_to_finite():
    x = torch.tensor([1e9, -1e9, float("inf"), 1.0])
    for fp8 in (E4M3, E5M2):
        q = quantize_ref(x, torch.tensor([1.0]), fp8).float()
        fmax = torch.finfo(fp8).max
        assert q.tolist() == [fmax, -fmax, fmax, 1.0]
