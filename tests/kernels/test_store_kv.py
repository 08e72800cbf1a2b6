"""store_kv (Triton) against store_kv_ref: strided key/value views, -1 slots, int32/int64."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import DEVICE, make_kv_cache

from nanopaged.kernels.store_kv import store_kv, store_kv_ref

CPU_DTYPES = [torch.float32, torch.float16]


def packed_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype):
    """key/value as non-contiguous views into one packed qkv projection output."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device=DEVICE).to(dtype)
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    return key, value


def run_case(num_tokens, block_size, num_kv_heads, head_dim, dtype, slot_dtype, layout):
    num_blocks = -(-num_tokens // block_size) + 4
    kv = make_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    if layout == "packed":
        key, value = packed_qkv(num_tokens, 2 * num_kv_heads, num_kv_heads, head_dim, dtype)
    else:  # head_dim not innermost in memory
        key = torch.randn(num_tokens, head_dim, num_kv_heads, device=DEVICE).to(dtype)
        value = torch.randn(num_tokens, head_dim, num_kv_heads, device=DEVICE).to(dtype)
        key, value = key.transpose(1, 2), value.transpose(1, 2)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[torch.rand(num_tokens, device=DEVICE) < 0.25] = -1
    slots = slots.to(slot_dtype)
    out, ref = kv.clone(), kv.clone()
    store_kv(key, value, out[0, 1], out[1, 1], slots)
    store_kv_ref(key, value, ref[0, 1], ref[1, 1], slots)
    assert torch.equal(out, ref)


@pytest.mark.parametrize(
    "num_tokens,block_size,num_kv_heads,head_dim,dtype,slot_dtype,layout",
    [
        (13, 8, 2, 64, torch.float32, torch.int64, "packed"),
        (40, 16, 1, 128, torch.float16, torch.int32, "packed"),
        (9, 32, 4, 64, torch.float16, torch.int64, "transposed"),
        (20, 128, 8, 128, torch.float32, torch.int32, "transposed"),
    ],
)
def test_store_kv(num_tokens, block_size, num_kv_heads, head_dim, dtype, slot_dtype, layout):
    run_case(num_tokens, block_size, num_kv_heads, head_dim, dtype, slot_dtype, layout)


def test_store_kv_empty():
    kv = make_kv_cache(2, 8, 2, 64, torch.float32)
    before = kv.clone()
    key = torch.randn(0, 2, 64, device=DEVICE)
    store_kv(key, key, kv[0, 0], kv[1, 0], torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(kv, before)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["packed", "transposed"])
def test_store_kv_gpu(dtype, layout):
    run_case(4096, 16, 8, 128, dtype, torch.int64, layout)
    run_case(1000, 32, 2, 64, dtype, torch.int32, layout)
