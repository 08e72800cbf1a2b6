"""paged_prefill (Triton) against paged_prefill_ref: cached prefixes, varlen, q_len 0 and 1."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_inputs import (
    DEVICE,
    assert_close,
    blocks_needed,
    make_block_tables,
    make_kv_cache,
    poison_allocator,
    step_slots,
)

from nanopaged.kernels.paged_prefill import paged_prefill, paged_prefill_launch, paged_prefill_ref

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16

# (block_size, group, head_dim, dtype, num_kv_heads), as in the decode tests.
CPU_CASES = [
    (8, 1, 64, f32, 2),
    (16, 2, 128, f16, 1),
    (32, 4, 64, f16, 1),
    (128, 8, 128, f32, 1),
    (16, 8, 64, f32, 1),
    (8, 4, 128, f16, 1),
    (32, 2, 128, f32, 1),
    (128, 1, 64, f16, 2),
]


def make_inputs(spec, block_size, group, head_dim, dtype, num_kv_heads):
    """spec: (cached prefix length, q_len) per sequence."""
    lens = [prefix + q_len for prefix, q_len in spec]
    kv = make_kv_cache(blocks_needed(lens, block_size), block_size, num_kv_heads, head_dim, dtype)
    block_tables = make_block_tables(lens, block_size, kv.shape[2])
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    cu = [0, *itertools.accumulate(q_len for _, q_len in spec)]
    cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    q = torch.randn(cu[-1], num_kv_heads * group, head_dim, device=DEVICE).to(dtype)
    max_seqlen_q = max(q_len for _, q_len in spec)
    return (q, kv[0, 1], kv[1, 1], block_tables, cu_seqlens_q, context_lens), max_seqlen_q


def mixed_spec(block_size: int) -> list[tuple[int, int]]:
    # Prefix 0, partial blocks and whole blocks; q_len 1, 0 and across block boundaries;
    # prefixes one short of a key-tile edge (126, 62) probe the unmasked/diagonal split.
    bs = block_size
    return [(0, 7), (3, 1), (bs, 9), (2, 0), (2 * bs, bs + 3), (bs // 2, 2 * bs + 1), (0, 1),
            (126, 3), (62, 18)]


def check(inputs, out, dtype):
    ref = paged_prefill_ref(*inputs, 0.1)
    assert out.shape == inputs[0].shape and out.dtype == inputs[0].dtype
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("block_size,group,head_dim,dtype,num_kv_heads", CPU_CASES)
def test_prefill(block_size, group, head_dim, dtype, num_kv_heads):
    inputs, max_q = make_inputs(mixed_spec(block_size), block_size, group, head_dim, dtype,
                                num_kv_heads)
    poison_allocator(inputs[0].numel(), dtype)
    check(inputs, paged_prefill(*inputs, 0.1, max_q), dtype)


# (prefetch distance, pack_gqa): the kernel's code-path variants.
VARIANTS = [(0, False), (1, False), (2, True), (1, True)]


@pytest.mark.parametrize("block_size,group,head_dim,dtype,num_kv_heads",
                         [*CPU_CASES[::2], (16, 3, 64, f32, 2)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_small_tiles(block_size, group, head_dim, dtype, num_kv_heads, variant):
    # 16x16 tiles: several query tiles per sequence and unmasked key tiles before the diagonal.
    inputs, max_q = make_inputs(mixed_spec(block_size), block_size, group, head_dim, dtype,
                                num_kv_heads)
    out = paged_prefill_launch(*inputs, 0.1, max_q, 16, 16, 4, 2, *variant)
    check(inputs, out, dtype)


def test_prefill_all_single_token():
    inputs, max_q = make_inputs([(5, 1), (0, 1), (40, 1)], 16, 2, 64, f32, 2)
    check(inputs, paged_prefill(*inputs, 0.1, max_q), f32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bf16, f16, f32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_prefill_gpu_realistic(dtype, group):
    gen = torch.Generator().manual_seed(group)
    prefixes = torch.randint(0, 2049, (12,), generator=gen).tolist()
    q_lens = torch.randint(1, 1025, (12,), generator=gen).tolist()
    spec = [*zip(prefixes, q_lens, strict=True), (0, 2048), (100, 0), (4096, 1)]
    inputs, max_q = make_inputs(spec, 16, group, 128, dtype, 8 // min(group, 4))
    poison_allocator(inputs[0].numel(), dtype)
    check(inputs, paged_prefill(*inputs, 0.1, max_q), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bf16, f16, f32])
@pytest.mark.parametrize("block_size", [8, 32, 128])
@pytest.mark.parametrize("head_dim", [32, 64, 256])
def test_prefill_gpu_block_sizes(dtype, block_size, head_dim):
    spec = [(0, 300), (block_size * 3, 1), (block_size * 2 + 5, 700), (17, 0), (1000, 129)]
    inputs, max_q = make_inputs(spec, block_size, 2, head_dim, dtype, 2)
    poison_allocator(inputs[0].numel(), dtype)
    check(inputs, paged_prefill(*inputs, 0.1, max_q), dtype)


def fresh_inputs(inputs, spec):
    """This step's K/V taken out of the cache (packed like q, as a strided view of a wider
    projection), after which the cache's copies of them are poisoned with NaN: a kernel that
    read them from the cache instead of k_new/v_new would return NaN."""
    q, k_cache, v_cache, block_tables, cu, context_lens = inputs
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    ref = paged_prefill_ref(*inputs, 0.1)
    slots = step_slots(block_tables, spec, block_size)
    wide = torch.randn(q.shape[0], 3 * num_kv_heads + 1, head_dim, device=DEVICE).to(q.dtype)
    k_new, v_new = wide[:, 1 : 1 + num_kv_heads], wide[:, 1 + num_kv_heads : 1 + 2 * num_kv_heads]
    for new, cache in ((k_new, k_cache), (v_new, v_cache)):
        flat = cache.view(-1, num_kv_heads, head_dim)
        new.copy_(flat[slots])
        flat[slots] = float("nan")
    return k_new, v_new, ref


def check_fresh(out, ref, dtype):
    assert not out.isnan().any()
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("block_size,group,head_dim,dtype,num_kv_heads",
                         [(16, 2, 128, f16, 1), (128, 1, 64, f16, 2), (16, 3, 64, f32, 2)])
@pytest.mark.parametrize("variant", [(1, False), (2, True)])
def test_prefill_fresh_kv(block_size, group, head_dim, dtype, num_kv_heads, variant):
    # This step's keys from k_new/v_new, the prefix from the cache: 16x16 tiles put whole
    # and partial prefix tiles, whole fresh tiles and diagonals in every sequence.
    spec = mixed_spec(block_size)
    inputs, max_q = make_inputs(spec, block_size, group, head_dim, dtype, num_kv_heads)
    k_new, v_new, ref = fresh_inputs(inputs, spec)
    out = paged_prefill_launch(*inputs, 0.1, max_q, 16, 16, 4, 2, *variant,
                               k_new=k_new, v_new=v_new)
    check_fresh(out, ref, dtype)


@pytest.mark.parametrize("variant", [(1, False), (0, True)])
def test_prefill_fresh_kv_no_prefix(variant):
    # has_prefix=False compiles the cached-prefix loops out: right when every context is just
    # this step's tokens.
    spec = [(0, 70), (0, 5), (0, 1), (0, 0), (0, 33)]
    inputs, max_q = make_inputs(spec, 16, 2, 64, f32, 2)
    k_new, v_new, ref = fresh_inputs(inputs, spec)
    out = paged_prefill_launch(*inputs, 0.1, max_q, 16, 16, 4, 2, *variant,
                               k_new=k_new, v_new=v_new, has_prefix=False)
    check_fresh(out, ref, f32)


def test_prefill_fresh_kv_default_config():
    spec = [(0, 70), (33, 5), (0, 1), (20, 0), (64, 130)]
    inputs, max_q = make_inputs(spec, 16, 2, 64, f16, 2)
    k_new, v_new, ref = fresh_inputs(inputs, spec)
    out = paged_prefill(*inputs, 0.1, max_q, k_new=k_new, v_new=v_new)
    check_fresh(out, ref, f16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bf16, f16, f32])
@pytest.mark.parametrize("head_dim", [32, 128, 256])
def test_prefill_fresh_kv_gpu(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    prefixes = torch.randint(0, 1025, (10,), generator=gen).tolist()
    q_lens = torch.randint(1, 1025, (10,), generator=gen).tolist()
    spec = [*zip(prefixes, q_lens, strict=True), (0, 2048), (100, 0), (3000, 1), (0, 300)]
    inputs, max_q = make_inputs(spec, 16, 2, head_dim, dtype, 4)
    k_new, v_new, ref = fresh_inputs(inputs, spec)
    check_fresh(paged_prefill(*inputs, 0.1, max_q, k_new=k_new, v_new=v_new), ref, dtype)
