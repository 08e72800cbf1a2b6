"""copy_blocks (Triton) against copy_blocks_ref over every layer, K and V."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import DEVICE, make_kv_cache

from nanopaged.kernels.copy_blocks import copy_blocks, copy_blocks_ref


def run_case(num_pairs, num_blocks, block_size, num_kv_heads, head_dim, num_layers, dtype):
    kv = make_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, num_layers)
    perm = torch.randperm(num_blocks, device=DEVICE)
    src, dst = perm[:num_pairs], perm[num_pairs : 2 * num_pairs]
    out, ref = kv.clone(), kv.clone()
    copy_blocks(out, src, dst)
    copy_blocks_ref(ref, src, dst)
    assert torch.equal(out, ref)


@pytest.mark.parametrize(
    "num_pairs,num_blocks,block_size,num_kv_heads,head_dim,num_layers,dtype",
    [
        (1, 4, 8, 1, 64, 1, torch.float32),
        (3, 10, 16, 2, 128, 3, torch.float16),
        (2, 6, 128, 4, 64, 2, torch.float32),
        (0, 4, 8, 2, 64, 2, torch.float32),
    ],
)
def test_copy_blocks(num_pairs, num_blocks, block_size, num_kv_heads, head_dim, num_layers, dtype):
    run_case(num_pairs, num_blocks, block_size, num_kv_heads, head_dim, num_layers, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_copy_blocks_gpu(dtype):
    run_case(100, 512, 16, 8, 128, 28, dtype)
    run_case(7, 64, 32, 2, 64, 4, dtype)
