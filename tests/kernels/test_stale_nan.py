"""K/V outside every context holds NaN or inf (a block's unused tail, blocks no table holds,
tiles past a context, a NaN request's slots and its rows of this step's K/V): no healthy row's
attention output changes. Each kernel and reference runs twice, over that dirty cache and over
the same values in a zero-filled one, and the healthy rows must be bit for bit the same."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from kernel_inputs import DEVICE, assert_close, step_slots
from test_mixed_step import metadata

from nanopaged.attention.triton import paged_attention
from nanopaged.kernels.paged_decode import paged_decode, paged_decode_launch, paged_decode_ref
from nanopaged.kernels.paged_prefill import paged_prefill, paged_prefill_launch, paged_prefill_ref
from nanopaged.kernels.store_kv import channel_major, is_fp8

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAN, INF = float("nan"), float("inf")
HEAD_DIM, NUM_KV_HEADS, SCALE = 32, 2, 0.2
# The interpreter runs fp32 and fp16 only; bf16 cases run on a GPU.
HALF = bf16 if DEVICE == "cuda" else f16
# The NaN requests' own rows are NaN: the interpreter's numpy warns while computing them.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@dataclass
class Step:
    """One step's attention inputs; k_new / v_new: its own K/V packed like q, as q's dtype."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def paged(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables)

    def scales(self) -> dict:
        return dict(k_scale=self.k_scale, v_scale=self.v_scale)


def tables_for(lens: list[int], block_size: int, num_blocks: int) -> torch.Tensor:
    """Block tables over blocks 2.. (shuffled); blocks 0 and 1 hold no context, and every
    padding entry points at block 1, so reads past a table or a context find stale values."""
    pool = (torch.randperm(num_blocks - 2) + 2).tolist()
    needed = [-(-n // block_size) for n in lens]
    tables = torch.ones(len(lens), max(needed) + 1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor(pool[at : at + n], dtype=torch.int32)
        at += n
    return tables.to(DEVICE)


def cache_values(num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> torch.Tensor:
    """Random K or V values for every slot, in fp32, each exactly representable in kv_dtype."""
    x = torch.randn(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    if is_fp8(kv_dtype):
        x = (x * 40).clamp(-200, 200)
    return x.to(kv_dtype).float()


def as_cache(x: torch.Tensor, kv_dtype: torch.dtype, v: bool) -> torch.Tensor:
    """x in kv_dtype; an 8-bit V channel-major, as the engine keeps it."""
    x = x.to(kv_dtype)
    if not (v and is_fp8(kv_dtype)):
        return x
    out = channel_major(torch.empty_like(x))
    out.copy_(x)
    return out


def make_steps(spec, block_size, group, dtype, kv_dtype, fill, bad=()) -> tuple[Step, Step]:
    """(clean, dirty) steps for spec, (cached prefix, q_len) per sequence: the same values in
    every context slot; past them zeros (clean) or fill (dirty). The sequences in bad are NaN
    requests in the dirty step: their slots and rows of k_new / v_new are NaN."""
    lens = [prefix + q_len for prefix, q_len in spec]
    num_blocks = sum(-(-n // block_size) for n in lens) + 4
    tables = tables_for(lens, block_size, num_blocks)
    cu = [0, *itertools.accumulate(q_len for _, q_len in spec)]
    slots = step_slots(tables, spec, block_size)
    valid = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    poisoned = valid.clone()
    for i, n in enumerate(lens):
        pos = torch.arange(n, device=DEVICE)
        seq_slots = tables[i, pos // block_size].long() * block_size + pos % block_size
        (poisoned if i in bad else valid)[seq_slots] = True
    bad_rows = torch.zeros(cu[-1], dtype=torch.bool, device=DEVICE)
    for i in bad:
        bad_rows[cu[i] : cu[i + 1]] = True
    q = torch.randn(cu[-1], NUM_KV_HEADS * group, HEAD_DIM, device=DEVICE).to(dtype)
    shared = dict(q=q, block_tables=tables, context_lens=torch.tensor(lens, device=DEVICE,
                  dtype=torch.int32), cu_seqlens_q=torch.tensor(cu, device=DEVICE,
                  dtype=torch.int32))  # fmt: skip
    if is_fp8(kv_dtype):
        shared.update(k_scale=torch.tensor([0.04], device=DEVICE),
                      v_scale=torch.tensor([0.025], device=DEVICE))  # fmt: skip
    else:
        shared.update(k_scale=None, v_scale=None)
    values = [cache_values(num_blocks, block_size, kv_dtype).view(-1, NUM_KV_HEADS, HEAD_DIM)
              for _ in range(2)]  # fmt: skip
    steps = []
    for outside, nan_rows in ((0.0, None), (fill, bad_rows)):
        caches, news = [], []
        for v, x in enumerate(values):
            new = x[slots].to(dtype)
            if nan_rows is not None:
                x = x.masked_fill(poisoned[:, None, None], NAN)
                new = new.masked_fill(nan_rows[:, None, None], NAN)
            x = x.masked_fill(~(valid | poisoned)[:, None, None], outside)
            caches.append(as_cache(x.view(num_blocks, block_size, *x.shape[1:]), kv_dtype, v))
            news.append(new)
        steps.append(Step(k_cache=caches[0], v_cache=caches[1], k_new=news[0], v_new=news[1],
                          **shared))  # fmt: skip
    return steps[0], steps[1]


def healthy_rows(step: Step, bad) -> torch.Tensor:
    """The rows of q that belong to no sequence in bad, [num_tokens] bool."""
    rows = torch.ones(step.q.shape[0], dtype=torch.bool, device=DEVICE)
    cu = step.cu_seqlens_q.tolist()
    for i in bad:
        rows[cu[i] : cu[i + 1]] = False
    return rows


def check_same(clean: dict, dirty: dict, healthy: torch.Tensor, dtype: torch.dtype) -> None:
    """Every output's healthy rows over the dirty cache equal those over the clean one, and
    each output over the clean cache is close to the reference's."""
    for name, out in clean.items():
        assert torch.equal(dirty[name][healthy], out[healthy]), name
        assert_close(out, clean["ref"], dtype)


def dirty_enough(step: Step) -> None:
    """The dirty caches hold non-finite values (the comparison is not vacuous)."""
    for cache in (step.k_cache, step.v_cache):
        assert (~cache.float().isfinite()).sum() >= cache[0].numel()


def decode_outputs(step: Step) -> dict[str, torch.Tensor]:
    """paged_decode by default, split in three over 16-token tiles, and its reference."""
    args = (*step.paged(), step.context_lens, SCALE)
    return {
        "kernel": paged_decode(*args, **step.scales()),
        "split": paged_decode_launch(*args, 3, 16, 2, 2, **step.scales()),
        "ref": paged_decode_ref(*args, **step.scales()),
    }


def prefill_outputs(step: Step, has_prefix: bool) -> dict[str, torch.Tensor]:
    """paged_prefill through the block table and with this step's K/V read directly, by
    default and in 16x16 tiles (GQA packed when there is a group), and its reference."""
    args = (*step.paged(), step.cu_seqlens_q, step.context_lens, SCALE)
    max_q = int((step.cu_seqlens_q[1:] - step.cu_seqlens_q[:-1]).max())
    tiles = (max_q, 16, 16, 4, 2, 1, step.q.shape[1] > NUM_KV_HEADS)
    fresh = dict(k_new=step.k_new, v_new=step.v_new, has_prefix=has_prefix)
    sc = step.scales()
    return {
        "kernel": paged_prefill(*args, max_q, **sc),
        "tiles": paged_prefill_launch(*args, *tiles, **sc),
        "fresh": paged_prefill(*args, max_q, **sc, **fresh),
        "fresh_tiles": paged_prefill_launch(*args, *tiles, **sc, **fresh),
        "ref": paged_prefill_ref(*args, **sc),
    }


def decode_spec(block_size: int) -> list[tuple[int, int]]:
    # Contexts ending inside a block, on a block's edge, short of a tile and past several.
    lens = [1, block_size - 1, 2 * block_size, block_size + 3, 3 * block_size + 5, 40]
    return [(n - 1, 1) for n in lens]


def prefill_spec(block_size: int) -> list[tuple[int, int]]:
    # Sequences 1 and 4 are the NaN requests: sequences 0 and 3 end in the middle of a key
    # tile whose rest is their rows of k_new / v_new.
    bs = block_size
    return [(0, 7), (0, 9), (3, 1), (bs, 9), (2, 5), (2 * bs, bs + 3), (bs // 2, 2 * bs + 1),
            (2, 0), (0, 1)]  # fmt: skip


PREFILL_BAD = (1, 4)
NO_PREFIX_SPEC, NO_PREFIX_BAD = [(0, 7), (0, 9), (0, 20), (0, 3), (0, 1)], (1, 3)
MIXED_SPEC, MIXED_BAD = [(40, 1), (3, 1), (0, 1), (0, 20), (0, 9), (17, 9), (5, 0)], (1, 4)
# (block_size, group, dtype, fill) for 16/32-bit caches
CASES = list(itertools.product([8, 16], [1, 4], [HALF, f32], [NAN, INF]))
# The prefill runs (the slow ones under the interpreter) take half of CASES, those with an even
# count of second values: every (block_size, group, dtype) still runs, once, and any two
# parameters still meet in all four pairs of their values.
PREFILL_CASES = [c for i, c in enumerate(CASES) if bin(i).count("1") % 2 == 0]
# (kv_dtype, dtype, fill, block_size, group): e4m3 has no inf (inf saturates to 448)
FP8_CASES = [(E4M3, HALF, NAN, 8, 4), (E4M3, f32, NAN, 16, 1), (E5M2, HALF, INF, 16, 1)]


def name(value) -> str:
    """Test ids: float16, not dtype0."""
    return str(value).removeprefix("torch.")


def check_decode(block_size, group, dtype, kv_dtype, fill) -> None:
    bad = (3,)
    clean, dirty = make_steps(decode_spec(block_size), block_size, group, dtype, kv_dtype,
                              fill, bad)  # fmt: skip
    dirty_enough(dirty)
    check_same(decode_outputs(clean), decode_outputs(dirty), healthy_rows(clean, bad), dtype)


def check_prefill(spec, bad, block_size, group, dtype, kv_dtype, fill) -> None:
    clean, dirty = make_steps(spec, block_size, group, dtype, kv_dtype, fill, bad)
    dirty_enough(dirty)
    has_prefix = any(prefix for prefix, _ in spec)
    check_same(prefill_outputs(clean, has_prefix), prefill_outputs(dirty, has_prefix),
               healthy_rows(clean, bad), dtype)  # fmt: skip


@pytest.mark.parametrize("block_size,group,dtype,fill", CASES, ids=name)
def test_decode(block_size, group, dtype, fill):
    check_decode(block_size, group, dtype, dtype, fill)


@pytest.mark.parametrize("fill", [NAN, INF])
def test_decode_equal_lengths(fill):
    # Every context as long as the longest: the reference's plan masks and zeroes nothing,
    # its gather stops at the contexts' end.
    clean, dirty = make_steps([(20, 1)] * 4, 8, 4, f32, f32, fill, bad=(2,))
    dirty_enough(dirty)
    check_same(decode_outputs(clean), decode_outputs(dirty), healthy_rows(clean, (2,)), f32)


@pytest.mark.parametrize("kv_dtype,dtype,fill,block_size,group", FP8_CASES, ids=name)
def test_decode_fp8(kv_dtype, dtype, fill, block_size, group):
    check_decode(block_size, group, dtype, kv_dtype, fill)


@pytest.mark.parametrize("block_size,group,dtype,fill", PREFILL_CASES, ids=name)
def test_prefill(block_size, group, dtype, fill):
    check_prefill(prefill_spec(block_size), PREFILL_BAD, block_size, group, dtype, dtype, fill)


@pytest.mark.parametrize("block_size,group,dtype,fill", CASES[::3], ids=name)
def test_prefill_no_prefix(block_size, group, dtype, fill):
    check_prefill(NO_PREFIX_SPEC, NO_PREFIX_BAD, block_size, group, dtype, dtype, fill)


@pytest.mark.parametrize("kv_dtype,dtype,fill,block_size,group", FP8_CASES, ids=name)
def test_prefill_fp8(kv_dtype, dtype, fill, block_size, group):
    check_prefill(prefill_spec(block_size), PREFILL_BAD, block_size, group, dtype, kv_dtype,
                  fill)  # fmt: skip
    check_prefill(NO_PREFIX_SPEC, NO_PREFIX_BAD, block_size, group, dtype, kv_dtype, fill)


def mixed_outputs(step: Step, num_decodes: int) -> dict[str, torch.Tensor]:
    """One mixed step through paged_attention (decode rows split off when num_decodes > 0), and
    the prefill reference over all of it."""
    inputs = (*step.paged(), step.cu_seqlens_q, step.context_lens)
    meta = metadata(inputs, MIXED_SPEC, num_decodes)
    out = paged_attention(step.q, step.k_new, step.v_new, step.k_cache, step.v_cache, meta, SCALE,
                        **step.scales())  # fmt: skip
    return {"kernel": out, "ref": paged_prefill_ref(*inputs, SCALE, **step.scales())}


@pytest.mark.parametrize("block_size,group,dtype,kv_dtype,fill",
                         [(16, 4, HALF, HALF, NAN), (8, 1, f32, f32, INF),
                          (16, 1, HALF, E4M3, NAN), (8, 4, f32, E4M3, NAN)], ids=name)  # fmt: skip
@pytest.mark.parametrize("num_decodes", [0, 3])
def test_mixed_step(block_size, group, dtype, kv_dtype, fill, num_decodes):
    clean, dirty = make_steps(MIXED_SPEC, block_size, group, dtype, kv_dtype, fill, MIXED_BAD)
    dirty_enough(dirty)
    check_same(mixed_outputs(clean, num_decodes), mixed_outputs(dirty, num_decodes),
               healthy_rows(clean, MIXED_BAD), dtype)  # fmt: skip


def test_make_steps_differ_only_outside_contexts():
    # The harness itself: the dirty cache equals the clean one on every healthy context slot
    # and is NaN on the NaN request's; k_new / v_new hold the stored values.
    spec = [(5, 3), (0, 4)]
    clean, dirty = make_steps(spec, 8, 1, f32, f32, INF, bad=(1,))
    table, n = clean.block_tables[0], 8
    for c, d in ((clean.k_cache, dirty.k_cache), (clean.v_cache, dirty.v_cache)):
        assert torch.equal(c[table[0], :n], d[table[0], :n]) and c.isfinite().all()
        assert d[clean.block_tables[1, 0], :4].isnan().all()
        assert d[0].isinf().all() and d[1].isinf().all()
    assert torch.equal(clean.k_new[:3], clean.k_cache[table[0], 5:8].float())
    assert dirty.k_new[3:].isnan().all() and not clean.k_new.isnan().any()
