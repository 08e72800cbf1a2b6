"""paged_decode (Triton) against paged_decode_ref: GQA, block sizes, split-KV, empty contexts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_inputs import (
    DEVICE,
    assert_close,
    blocks_needed,
    make_block_tables,
    make_kv_cache,
    poison_allocator,
)

from nanopaged.kernels.paged_decode import (
    choose_num_splits,
    longest_first,
    paged_decode,
    paged_decode_launch,
    paged_decode_ref,
)

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16

# (block_size, group, head_dim, dtype, num_kv_heads): every block size, GQA ratio and head_dim
# appears; the interpreter handles fp32 and fp16 (bf16 runs on the GPU only).
CPU_CASES = [
    (8, 1, 64, f32, 2),
    (16, 2, 128, f16, 2),
    (32, 4, 64, f16, 1),
    (128, 8, 128, f32, 1),
    (16, 8, 64, f16, 1),
    (8, 4, 128, f32, 2),
    (32, 2, 128, f32, 1),
    (128, 1, 64, f16, 2),
    (16, 3, 64, f32, 2),  # a group that is not a power of two
]


def make_inputs(lens, block_size, group, head_dim, dtype, num_kv_heads):
    kv = make_kv_cache(blocks_needed(lens, block_size), block_size, num_kv_heads, head_dim, dtype)
    block_tables = make_block_tables(lens, block_size, kv.shape[2])
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, device=DEVICE).to(dtype)
    return q, kv[0, 1], kv[1, 1], block_tables, context_lens


def mixed_lens(block_size: int) -> list[int]:
    return [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 2 * block_size]


def check(q, k_cache, v_cache, block_tables, context_lens, out, dtype):
    ref = paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, 0.1)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("block_size,group,head_dim,dtype,num_kv_heads", CPU_CASES)
def test_decode(block_size, group, head_dim, dtype, num_kv_heads):
    inputs = make_inputs(mixed_lens(block_size), block_size, group, head_dim, dtype, num_kv_heads)
    poison_allocator(inputs[0].numel(), dtype)
    check(*inputs, paged_decode(*inputs, 0.1), dtype)


@pytest.mark.parametrize("block_size,group,head_dim,dtype,num_kv_heads", CPU_CASES)
@pytest.mark.parametrize("num_splits,prefetch", [(1, True), (3, True), (3, False), (7, True),
                                                 (64, True)])
def test_decode_small_tiles(block_size, group, head_dim, dtype, num_kv_heads, num_splits,
                            prefetch):
    # 16-token tiles: many loop iterations, tiles smaller than a block, splits inside blocks.
    # Each sequence spreads its context over the splits: with 64, short contexts fill only
    # some of them (one tile each), and the merge skips the rest.
    lens = mixed_lens(block_size)
    inputs = make_inputs(lens, block_size, group, head_dim, dtype, num_kv_heads)
    out = paged_decode_launch(*inputs, 0.1, num_splits, 16, 4, 2, prefetch)
    check(*inputs, out, dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_launch_order_changes_nothing(num_splits):
    # Programs started longest context first (longest_first's order, ties in row order):
    # each row's output is what row order gives, bit for bit, split or not.
    lens = [5, 40, 0, 40, 17, 3 * 16 + 5]
    inputs = make_inputs(lens, 16, 2, 64, f32, 2)
    order_np = longest_first(np.array(lens, dtype=np.int32))
    assert order_np.tolist() == [5, 1, 3, 4, 0, 2] and order_np.dtype == np.int32
    order = torch.from_numpy(order_np).to(DEVICE)
    plain = paged_decode_launch(*inputs, 0.1, num_splits, 16, 4, 2)
    poison_allocator(plain.numel(), plain.dtype)
    ordered = paged_decode_launch(*inputs, 0.1, num_splits, 16, 4, 2, order=order)
    assert torch.equal(ordered, plain)
    check(*inputs, ordered, f32)
    via_api = paged_decode(*inputs, 0.1, order=order)
    check(*inputs, via_api, f32)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_decode_empty_context_writes_zeros(num_splits):
    lens = [0, 19, 0, 40]
    q, k_cache, v_cache, block_tables, context_lens = make_inputs(lens, 8, 2, 64, f32, 2)
    poison_allocator(q.numel(), q.dtype)
    out = paged_decode_launch(q, k_cache, v_cache, block_tables, context_lens, 0.1,
                              num_splits, 16, 4, 2)
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
    ref = paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, 0.1)
    assert_close(out[[1, 3]], ref[[1, 3]], f32)


def test_decode_split_by_max_context_len():
    # One sequence, one KV head: the split heuristic must split a 600-token context.
    lens = [600]
    inputs = make_inputs(lens, 16, 4, 64, f16, 1)
    check(*inputs, paged_decode(*inputs, 0.1, max_context_len=600), f16)


def test_split_count_bands():
    # 132 SMs, 8 KV heads, graphs captured for 4,096-token contexts: under one program per SM
    # the contexts spread finely; up to 1.5 programs per SM in three, up to 2.5 in two; above
    # that, unsplit; and never more splits than tiles.
    def splits(batch, max_context_len=4096):
        return choose_num_splits(batch, 8, max_context_len, 64, 132)

    assert splits(1) == 33 and splits(16) == 16
    assert splits(17) == splits(24) == 3
    assert splits(25) == splits(41) == 2
    assert splits(42) == splits(64) == splits(256) == 1
    assert splits(24, max_context_len=100) == 2  # two tiles
    assert splits(256, max_context_len=65536) == 2  # long contexts bound a program's work


def test_decode_rejects_odd_head_dim():
    inputs = make_inputs([5], 8, 1, 64, f32, 1)
    q = torch.randn(1, 1, 80, device=DEVICE)
    k = torch.randn(2, 8, 1, 80, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode(q, k, k, inputs[3], inputs[4], 0.1)


def test_refs_import_without_triton():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from nanopaged.kernels import paged_decode, paged_prefill, store_kv, copy_blocks\n"
        "assert paged_decode.triton is None and paged_prefill.triton is None\n"
        "assert store_kv.triton is None and copy_blocks.triton is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bf16, f16, f32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_gpu_realistic(dtype, group):
    gen = torch.Generator().manual_seed(group)
    lens = torch.randint(1, 4097, (64,), generator=gen).tolist()
    inputs = make_inputs(lens, 16, group, 128, dtype, 8 // min(group, 4))
    poison_allocator(inputs[0].numel(), dtype)
    check(*inputs, paged_decode(*inputs, 0.1), dtype)
    check(*inputs, paged_decode(*inputs, 0.1, max_context_len=4096), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bf16, f16, f32])
@pytest.mark.parametrize("block_size", [8, 32, 128])
@pytest.mark.parametrize("head_dim", [32, 64, 256])
def test_decode_gpu_long_small_batch(dtype, block_size, head_dim):
    # Few sequences, long contexts: the split-KV path with its log-sum-exp merge.
    lens = [8192, 1, 5000, block_size * 37 + 3]
    inputs = make_inputs(lens, block_size, 4, head_dim, dtype, 2)
    poison_allocator(inputs[0].numel(), dtype)
    check(*inputs, paged_decode(*inputs, 0.1), dtype)


@pytest.mark.gpu
def test_decode_gpu_cuda_graph():
    # Capture once, then change q, context lengths and tables in place and replay.
    max_len, batch = 4096, 4
    kv = make_kv_cache(batch * max_len // 16, 16, 8, 128, bf16)
    k_cache, v_cache = kv[0, 1], kv[1, 1]
    q = torch.randn(batch, 16, 128, device=DEVICE).to(bf16)
    context_lens = torch.tensor([300, 17, 4000, 1], dtype=torch.int32, device=DEVICE)
    table = torch.randperm(k_cache.shape[0], device=DEVICE).to(torch.int32).view(batch, -1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_decode(q, k_cache, v_cache, table, context_lens, 0.1, max_context_len=max_len)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode(q, k_cache, v_cache, table, context_lens, 0.1, max_context_len=max_len)
    for new_lens in ([300, 17, 4000, 1], [1, 250, 4096, 64]):
        q.copy_(torch.randn_like(q))
        context_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        perm = torch.randperm(k_cache.shape[0], device=DEVICE)[: table.numel()].view_as(table)
        table.copy_(perm.to(torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        check(q, k_cache, v_cache, table, context_lens, out, bf16)
