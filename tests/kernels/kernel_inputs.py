"""Random paged-attention inputs shared by the kernel tests (never zeros, shuffled tables)."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Tolerance by dtype for outputs of magnitude ~1 (averages of randn values).
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def poison_allocator(numel: int, dtype: torch.dtype, device: str = DEVICE) -> None:
    """Fill a freed buffer with NaN so a following torch.empty of that size likely reuses it."""
    buf = torch.full((numel,), float("nan"), dtype=dtype, device=device)
    del buf


def make_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_layers: int = 2,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Random full cache [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=generator, device=DEVICE).to(dtype)


def make_block_tables(
    context_lens: list[int],
    block_size: int,
    num_blocks: int,
    generator: torch.Generator | None = None,
    extra_blocks: int = 1,
) -> torch.Tensor:
    """Block tables [batch, max_blocks] int32 over a shuffled pool; padding entries are 0."""
    needed = [-(-n // block_size) for n in context_lens]
    assert sum(needed) <= num_blocks, (sum(needed), num_blocks)
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(needed, default=0) + extra_blocks
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    at = 0
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor(pool[at : at + n], dtype=torch.int32)
        at += n
    return tables.to(DEVICE)


def step_slots(block_tables: torch.Tensor, spec, block_size: int) -> torch.Tensor:
    """The cache slots of each sequence's step tokens, packed like q; spec: (cached prefix
    length, q_len) per sequence."""
    slots = []
    for i, (prefix, q_len) in enumerate(spec):
        pos = torch.arange(prefix, prefix + q_len, device=DEVICE)
        slots.append(block_tables[i, pos // block_size].long() * block_size + pos % block_size)
    return torch.cat(slots)


def blocks_needed(context_lens: list[int], block_size: int) -> int:
    """Total physical blocks for these contexts, plus slack so the pool is not all used."""
    return sum(-(-n // block_size) for n in context_lens) + 3


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Elementwise closeness by dtype, no NaN anywhere, and a small relative norm error."""
    assert not out.isnan().any(), "NaN in kernel output"
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    rel = (out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)
    assert rel < {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype], rel
