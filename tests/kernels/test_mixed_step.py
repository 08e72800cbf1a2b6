"""A step mixing decodes and prefill chunks: the leading decode rows through the decode kernel,
the rest through the prefill kernel (with this step's K/V read directly), one output."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import DEVICE, assert_close, step_slots
from test_paged_prefill import make_inputs

from nanopaged.attention.triton import TritonMetadata, paged_attention
from nanopaged.kernels import paged_decode
from nanopaged.kernels.paged_prefill import paged_prefill_ref

f32, f16 = torch.float32, torch.float16


def step_kv(inputs, spec):
    """This step's K/V (the last q_len positions of each sequence) gathered from the cache,
    packed like q."""
    q, k_cache, v_cache, block_tables, _, _ = inputs
    slots = step_slots(block_tables, spec, k_cache.shape[1])
    return tuple(c.view(-1, *c.shape[2:])[slots] for c in (k_cache, v_cache))


def metadata(inputs, spec, num_decodes):
    q, _, _, block_tables, cu, context_lens = inputs
    q_lens = [q_len for _, q_len in spec]
    assert all(n == 1 for n in q_lens[:num_decodes])
    cu_prefill = (cu[num_decodes:] - cu[num_decodes]).contiguous() if num_decodes else None
    return TritonMetadata(
        slot_mapping=torch.full((q.shape[0],), -1, device=DEVICE),
        block_tables=block_tables, context_lens=context_lens, cu_seqlens_q=cu,
        max_seqlen_q=max(q_lens), max_context_len=int(context_lens.max()),
        has_prefix=any(p > 0 for p, _ in spec[num_decodes:]),
        num_decodes=num_decodes, cu_seqlens_prefill=cu_prefill,
    )  # fmt: skip


@pytest.mark.parametrize("dtype,group,num_kv_heads", [(f32, 2, 2), (f16, 4, 1)])
@pytest.mark.parametrize("num_decodes", [0, 3])
def test_mixed_step(dtype, group, num_kv_heads, num_decodes, monkeypatch):
    # Three decode rows (long, short and one-token contexts) then chunks with and without
    # cached prefixes; num_decodes=0 runs all of them through the prefill kernel.
    spec = [(40, 1), (3, 1), (0, 1), (0, 20), (17, 9), (33, 1), (5, 0)]
    inputs, _ = make_inputs(spec, 16, group, 64, dtype, num_kv_heads)
    k, v = step_kv(inputs, spec)
    meta = metadata(inputs, spec, num_decodes)
    q, k_cache, v_cache = inputs[:3]
    decode_batches = []
    decode = paged_decode.paged_decode

    def spy(q, *args, **kwargs):
        decode_batches.append(q.shape[0])
        return decode(q, *args, **kwargs)

    monkeypatch.setattr(paged_decode, "paged_decode", spy)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.1)
    assert decode_batches == ([num_decodes] if num_decodes else [])
    assert_close(out, paged_prefill_ref(*inputs, 0.1), dtype)


def test_mixed_step_no_prefix_after_decodes():
    # The prefill part has no cached prefix (has_prefix=False) while the decode rows do.
    spec = [(30, 1), (12, 1), (0, 25), (0, 3)]
    inputs, _ = make_inputs(spec, 8, 2, 32, f32, 2)
    k, v = step_kv(inputs, spec)
    meta = metadata(inputs, spec, 2)
    assert not meta.has_prefix
    out = paged_attention(*inputs[:1], k, v, *inputs[1:3], meta, 0.1)
    assert_close(out, paged_prefill_ref(*inputs, 0.1), f32)
