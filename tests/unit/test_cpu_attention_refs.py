"""The CPU attention references against a plain per-sequence softmax, NaN in unused slots."""

from __future__ import annotations

import pytest
import torch

from nanopaged.kernels.paged_decode import decode_plan, paged_decode_ref
from nanopaged.kernels.paged_prefill import paged_prefill_ref
from nanopaged.kernels.store_kv import store_kv_ref

BLOCK_SIZE = 8


def naive_attention(q, k, v, q_pos, scale):
    """q: [q_len, num_heads, head_dim]; k, v: [context_len, num_kv_heads, head_dim]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    hidden = torch.arange(k.shape[0])[None, None, :] > q_pos[None, :, None]
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.double()).float()


def paged_inputs(lens, num_kv_heads, head_dim, seed=0):
    """A NaN-filled cache holding only the contexts' tokens, on shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(needed) + 4
    k_cache = torch.full((num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), float("nan"))
    v_cache = k_cache.clone()
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), max(needed) + 1, dtype=torch.int32)
    contexts = []
    for i, n in enumerate(lens):
        tables[i, : needed[i]] = torch.tensor(pool[: needed[i]], dtype=torch.int32)
        pool = pool[needed[i] :]
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        pos = torch.arange(n)
        slots = tables[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        store_kv_ref(k, v, k_cache, v_cache, slots)
        contexts.append((k, v))
    return k_cache, v_cache, tables, contexts


@pytest.mark.parametrize("lens", [[37], [16, 16], [1, 7, 8, 9, 30], [0, 12, 0, 5]])
@pytest.mark.parametrize("group", [1, 3])
def test_decode_ref_matches_naive(lens, group):
    k_cache, v_cache, tables, contexts = paged_inputs(lens, 2, 32)
    q = torch.randn(len(lens), 2 * group, 32)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_ref(q, k_cache, v_cache, tables, context_lens, 0.2)
    plan = decode_plan(tables, context_lens, BLOCK_SIZE)
    planned = paged_decode_ref(q, k_cache, v_cache, tables, context_lens, 0.2, plan=plan)
    assert torch.equal(out, planned)
    for i, (k, v) in enumerate(contexts):
        if lens[i] == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i]))
            continue
        ref = naive_attention(q[i : i + 1], k, v, torch.tensor([lens[i] - 1]), 0.2)
        torch.testing.assert_close(out[i], ref[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_lens,lens", [([5], [5]), ([3, 1, 9], [20, 13, 9]), ([1, 1], [4, 17])])
@pytest.mark.parametrize("group", [1, 3])
def test_prefill_ref_matches_naive(q_lens, lens, group):
    k_cache, v_cache, tables, contexts = paged_inputs(lens, 2, 32, seed=1)
    q = torch.randn(sum(q_lens), 2 * group, 32)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_prefill_ref(q, k_cache, v_cache, tables, cu, context_lens, 0.2)
    assert not out.isnan().any()
    for i, (k, v) in enumerate(contexts):
        q_pos = torch.arange(lens[i] - q_lens[i], lens[i])
        ref = naive_attention(q[cu[i] : cu[i + 1]], k, v, q_pos, 0.2)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], ref, atol=1e-5, rtol=1e-5)


def test_store_kv_ref_skips_negative_slots():
    k_cache = torch.zeros(2, BLOCK_SIZE, 1, 4)
    v_cache = torch.zeros_like(k_cache)
    key = torch.arange(12.0).view(3, 1, 4)
    store_kv_ref(key, -key, k_cache, v_cache, torch.tensor([3, -1, 9]))
    flat = k_cache.view(-1, 1, 4)
    assert torch.equal(flat[3], key[0]) and torch.equal(flat[9], key[2])
    assert torch.equal(v_cache.view(-1, 1, 4)[9], -key[2])
    assert flat.abs().sum() == key[0].sum() + key[2].sum()


@pytest.mark.parametrize("slots", [[3, -1, 9], [3, 4, 9]])
def test_attention_layer_records_skipped_slots_for_the_step(slots):
    from nanopaged.attention import Attention, TorchAttention, TorchMetadata

    backend = TorchAttention()
    layers = [Attention(num_heads=2, head_dim=4, num_kv_heads=1, scale=0.5) for _ in range(2)]
    for layer in layers:
        layer.k_cache = torch.zeros(2, BLOCK_SIZE, 1, 4)
        layer.v_cache = torch.zeros(2, BLOCK_SIZE, 1, 4)
    meta = TorchMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([[0, 1]] * 3, dtype=torch.int32),
        context_lens=torch.tensor([4, 1, 10], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32), max_seqlen_q=1,
        max_context_len=10,
    )  # fmt: skip
    key = torch.arange(1.0, 13.0).view(3, 1, 4)
    plans = []
    for layer in layers:  # the second layer reuses the first one's findings
        backend.attend(layer, torch.ones(3, 2, 4), key, -key, meta)  # after rotary
        plans.append(meta.decode_plan)
        flat = layer.k_cache.view(-1, 1, 4)
        stored = [i for i, slot in enumerate(slots) if slot >= 0]
        assert meta.skips_slots == (len(stored) < len(slots))
        assert flat.abs().sum() == key[stored].sum()
        for i in stored:
            assert torch.equal(flat[slots[i]], key[i])
            assert torch.equal(layer.v_cache.view(-1, 1, 4)[slots[i]], -key[i])
    assert plans[0] is not None and plans[1] is plans[0]


@pytest.mark.parametrize("lens", [[37, 5, 16], [1, 30, 0, 9]])
def test_decode_ref_bf16_attends_in_bf16_and_skips_stale_nan(lens):
    # A bf16 cache is attended in bf16 (fp32 accumulation inside SDPA), as the kernel's dots
    # take 16-bit operands; the NaN past each context in the gathered blocks never reaches a
    # sum, and the gather is zeroed only where the plan says.
    k_cache, v_cache, tables, contexts = paged_inputs(lens, 2, 32, seed=3)
    k16, v16 = k_cache.bfloat16(), v_cache.bfloat16()
    q = torch.randn(len(lens), 6, 32).bfloat16()
    context_lens = torch.tensor(lens, dtype=torch.int32)
    plan = decode_plan(tables, context_lens, BLOCK_SIZE)
    stale_rows = plan.stale.numel()
    assert stale_rows == sum(max(lens) - n for n in lens)
    out = paged_decode_ref(q, k16, v16, tables, context_lens, 0.2, plan=plan)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    for i, (k, v) in enumerate(contexts):
        if lens[i] == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i]))
            continue
        ref = naive_attention(q[i : i + 1].float(), k.bfloat16().float(), v.bfloat16().float(),
                              torch.tensor([lens[i] - 1]), 0.2)  # fmt: skip
        torch.testing.assert_close(out[i].float(), ref[0], atol=2e-2, rtol=2e-2)
