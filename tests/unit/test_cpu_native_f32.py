"""The C decode kernels an fp32 model runs on CPU (kernels/cpu_native.c): rotary and the KV
store bit for bit their torch references, decode attention within fp32 rounding of SDPA's."""

from __future__ import annotations

import pytest
import torch
from test_cpu_native import _decode_inputs, needs_kernels

from nanopaged.kernels import cpu_native
from nanopaged.kernels.paged_decode import paged_decode_ref
from nanopaged.kernels.rotary import rotary_tables_ref, rotate_ref
from nanopaged.kernels.store_kv import store_kv_ref
from nanopaged.layers.rotary import RotaryEmbedding

F32 = torch.float32


def _f32_inputs(lens, block_size, heads, kv_heads, dim, seed):
    """_decode_inputs in fp32 (NaN past each context, q strided)."""
    q, k_cache, v_cache, tables, context_lens = _decode_inputs(
        lens, block_size, heads, kv_heads, dim, seed
    )
    return q.float(), k_cache.float(), v_cache.float(), tables, context_lens


@needs_kernels
@pytest.mark.parametrize(
    "block_size,heads,kv_heads,dim",
    [(16, 9, 3, 64), (8, 4, 4, 128), (32, 8, 2, 64), (16, 12, 3, 48), (16, 6, 2, 40)],
)
def test_paged_decode_f32_matches_reference(block_size, heads, kv_heads, dim):
    lens = [0, 1, block_size, block_size + 1, 3 * block_size - 1, 300, 17, 64]
    q, k_cache, v_cache, tables, context_lens = _f32_inputs(
        lens, block_size, heads, kv_heads, dim, seed=block_size + dim
    )
    scale = dim**-0.5
    expected = paged_decode_ref(q, k_cache, v_cache, tables, context_lens, scale)
    out = cpu_native.paged_decode(q, k_cache, v_cache, tables, context_lens, scale, max(lens))
    assert out.dtype == F32 and out.shape == expected.shape
    assert (out[0] == 0).all()  # the empty context: zeros, as the kernel writes
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (6, 2, 40)])
def test_rotary_decode_f32_is_rotate_store_then_decode(heads, kv_heads, dim):
    lens, block_size = [7, 1, 33, 16, 90], 16
    _, k_cache, v_cache, tables, context_lens = _f32_inputs(
        lens, block_size, heads, kv_heads, dim, seed=dim
    )
    batch = len(lens)
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, generator=gen) * 2
    q = qkv[:, : heads * dim].view(batch, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(batch, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(batch, kv_heads, dim)
    rotary = RotaryEmbedding(dim, 512, 10000.0)
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.tensor(
        [int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
         for i, n in enumerate(lens)]
    )  # fmt: skip
    slots[3] = -1  # a token not to store: its slot keeps what it held
    caches = (k_cache.clone(), v_cache.clone())
    # The references: rotary (fp32 tables), the store, then the C decode over that cache.
    cos_t, sin_t = rotary_tables_ref(rotary.cos, rotary.sin, positions, F32)
    qr, kr = rotate_ref(q, cos_t, sin_t), rotate_ref(k, cos_t, sin_t)
    store_kv_ref(kr, v, k_cache, v_cache, slots)
    expected = cpu_native.paged_decode(qr, k_cache, v_cache, tables, context_lens, 0.1, 90)
    out = cpu_native.rotary_decode(
        q, k, v, positions, rotary.cos, rotary.sin, *caches, slots, tables, context_lens, 0.1, 90
    )
    # Bit for bit: the rotation rounds each product as torch does (no fused multiply-add).
    assert torch.equal(torch.nan_to_num(caches[0]), torch.nan_to_num(k_cache))
    assert torch.equal(torch.nan_to_num(caches[1]), torch.nan_to_num(v_cache))
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(expected))
    assert torch.isfinite(out[[0, 1, 2, 4]]).all()
    reference = paged_decode_ref(qr, k_cache, v_cache, tables, context_lens, 0.1)
    torch.testing.assert_close(out[[0, 1, 2, 4]], reference[[0, 1, 2, 4]], atol=2e-6, rtol=2e-5)


@needs_kernels
def test_decode_dtypes_must_agree():
    q, k_cache, v_cache, tables, lens = _f32_inputs([5, 40], 16, 4, 2, 64, seed=0)
    with pytest.raises(TypeError, match="k_cache must be torch.float32"):
        cpu_native.paged_decode(q, k_cache.bfloat16(), v_cache, tables, lens, 0.125, 40)
    with pytest.raises(TypeError, match="q must be torch.bfloat16 or torch.float32"):
        cpu_native.paged_decode(q.half(), k_cache, v_cache, tables, lens, 0.125, 40)
