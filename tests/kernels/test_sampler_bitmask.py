"""Token bitmasks (structured outputs) inside the fused sampler and argmax: kernel vs reference."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import DEVICE
from test_sampler_kernel import (
    PLAIN,
    SETTINGS,
    chi_square_check,
    distinct_logits,
    keys,
    settings_tensors,
)

from nanopaged.kernels.sampler import (
    allowed_mask_fused,
    allowed_mask_ref,
    apply_bitmask_ref,
    argmax_ref,
    sample_ref,
)
from nanopaged.kernels.sampler_chunks import argmax_fused, sample_fused

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [rows, vocab] -> the packed int32 bitmask [rows, ceil(vocab / 32)], written
    bit by bit (an oracle independent of apply_bitmask_ref's unpacking)."""
    rows, vocab = allowed.shape
    words = torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int64)
    for t in range(vocab):
        words[:, t // 32] |= allowed[:, t].long().cpu() << (t % 32)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement as int32
    return words.to(torch.int32).to(allowed.device)


def random_allowed(rows: int, vocab: int, seed: int, keep: float = 0.5) -> torch.Tensor:
    """bool [rows, vocab], about `keep` of each row allowed and at least one token."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, vocab, generator=gen) < keep
    allowed[torch.arange(rows), torch.randint(vocab, (rows,), generator=gen)] = True
    return allowed.to(DEVICE)


def mask_rows(batch: int, unconstrained: tuple[int, ...]) -> torch.Tensor:
    """Row i takes bitmask row batch - 1 - i (not the identity), -1 for the unconstrained."""
    rows = torch.arange(batch - 1, -1, -1, dtype=torch.int32)
    rows[list(unconstrained)] = -1
    return rows.to(DEVICE)


def test_apply_bitmask_ref_unpacks_bits():
    vocab = 75  # a partial last word
    allowed = random_allowed(4, vocab, seed=1)
    allowed[0, 31] = allowed[0, 63] = True  # the sign bit of a word
    allowed[1] = False
    allowed[1, [0, 31, 32, 74]] = True
    bitmask = pack(allowed)
    logits = torch.randn(4, vocab, device=DEVICE)
    got = apply_bitmask_ref(logits, bitmask)
    assert torch.equal(got.isfinite(), allowed)
    assert torch.equal(got[allowed], logits[allowed])
    # -1: unconstrained; other rows pick their mask by index.
    rows = torch.tensor([-1, 0, 3, -1], dtype=torch.int32, device=DEVICE)
    got = apply_bitmask_ref(logits, bitmask, rows)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[3], logits[3])
    assert torch.equal(got[1].isfinite(), allowed[0]) and torch.equal(got[2].isfinite(), allowed[3])
    # A vocabulary shard: columns are token ids vocab_start.. of the full mask.
    shard = logits[:, 40:]
    got = apply_bitmask_ref(shard, bitmask, vocab_start=40)
    assert torch.equal(got.isfinite(), allowed[:, 40:])


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_masked_allowed_set_equals_ref(dtype):
    batch, vocab = len(SETTINGS), 200
    logits = distinct_logits(batch, vocab, dtype, seed=21)
    allowed = random_allowed(batch, vocab, seed=2)
    bitmask = pack(allowed)
    rows = mask_rows(batch, unconstrained=(1, 4))
    filters = settings_tensors(SETTINGS)
    got = allowed_mask_fused(logits, *filters, block=64, bitmask=bitmask, bitmask_rows=rows)
    ref = allowed_mask_ref(apply_bitmask_ref(logits, bitmask, rows), *filters)
    assert torch.equal(got, ref), (got != ref).sum(dim=1)
    constrained = rows >= 0
    assert not (ref[constrained] & ~allowed[rows[constrained].long()]).any()
    # The filters act on the allowed tokens: top-k 20 keeps 20 of them, not fewer.
    assert ref[2].sum() == 20


@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("num_logprobs", [0, 3])
def test_masked_tokens_and_logprobs_equal_ref(dtype, num_logprobs):
    batch, vocab = len(SETTINGS), 160
    logits = distinct_logits(batch, vocab, dtype, seed=12)
    allowed = random_allowed(batch, vocab, seed=3, keep=0.3)
    bitmask = pack(allowed)
    rows = mask_rows(batch, unconstrained=(3,))
    filters = settings_tensors(SETTINGS)
    seeds, offsets = keys(batch)
    kw = dict(num_logprobs=num_logprobs, bitmask=bitmask, bitmask_rows=rows)
    out = sample_fused(logits, *filters, seeds, offsets, block=64, **kw)
    ref = sample_ref(logits, *filters, seeds, offsets, **kw)
    assert torch.equal(out.token_ids, ref.token_ids)
    torch.testing.assert_close(out.scores, ref.scores)
    masked = apply_bitmask_ref(logits, bitmask, rows).float()
    assert masked.gather(1, out.token_ids[:, None]).isfinite().all()  # only allowed tokens
    greedy = filters[0] == 0
    assert torch.equal(out.token_ids[greedy], masked.argmax(dim=1)[greedy])
    # Logprobs of the masked distribution.
    lp = masked.log_softmax(dim=1)
    torch.testing.assert_close(out.logprobs, lp.gather(1, out.token_ids[:, None])[:, 0])
    if num_logprobs:
        top, top_ids = lp.topk(num_logprobs, dim=1)
        torch.testing.assert_close(out.top_logprobs, top)
        assert torch.equal(out.top_token_ids, top_ids)
    # The masks really change the draw: some constrained row differs from its unmasked one.
    free = sample_ref(logits, *filters, seeds, offsets)
    assert not torch.equal(free.token_ids, out.token_ids)


@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("vocab,block", [(300, 64), (97, 64)])
def test_masked_argmax_equals_ref(dtype, vocab, block):
    batch = 6
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(batch, vocab, generator=gen).to(dtype).to(DEVICE)
    logits[2, 5] = float("nan")  # masked out below: the NaN never wins
    allowed = random_allowed(batch, vocab, seed=4, keep=0.1)
    allowed[2, 5] = False
    bitmask = pack(allowed)
    rows = mask_rows(batch, unconstrained=(0,))
    got = argmax_fused(logits, block, bitmask, rows)
    ref = argmax_ref(logits, bitmask, rows)
    assert torch.equal(got, ref)
    assert torch.equal(ref, apply_bitmask_ref(logits, bitmask, rows).float().argmax(dim=1))
    assert got[0] == logits[0].float().argmax()
    assert not torch.equal(got, logits.float().argmax(dim=1))


@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("num_logprobs", [0, 2])
def test_masked_plain_rows_drawn_in_chunks(dtype, num_logprobs):
    batch, vocab = len(PLAIN), 300
    settings = [(t, 0, 1.0, 0.05 if i == 2 else 0.0) for i, (t, *_) in enumerate(PLAIN)]
    logits = distinct_logits(batch, vocab, dtype, seed=13)
    bitmask = pack(random_allowed(batch, vocab, seed=5))
    rows = mask_rows(batch, unconstrained=(1,))
    filters = settings_tensors(settings)
    seeds, offsets = keys(batch)
    kw = dict(num_logprobs=num_logprobs, bitmask=bitmask, bitmask_rows=rows)
    out = sample_fused(logits, *filters, seeds, offsets, plain=True, block=64, **kw)
    ref = sample_ref(logits, *filters, seeds, offsets, **kw)
    assert torch.equal(out.token_ids, ref.token_ids)
    torch.testing.assert_close(out.scores, ref.scores)
    torch.testing.assert_close(out.logprobs, ref.logprobs)
    if num_logprobs:
        torch.testing.assert_close(out.top_logprobs, ref.top_logprobs)


def test_masked_top_p_rows_without_top_k_equal_ref():
    # Rows without top-k take the full kernel when masked (the frontier draw has no mask).
    settings = [(1.0, 0, 0.9, 0.0), (0.7, 0, 0.5, 0.02), (0.0, 0, 1.0, 0.0), (1.2, 0, 1.0, 0.0)]
    batch, vocab = len(settings), 200
    logits = distinct_logits(batch, vocab, f32, seed=14)
    bitmask = pack(random_allowed(batch, vocab, seed=6))
    filters = settings_tensors(settings)
    seeds, offsets = keys(batch)
    out = sample_fused(logits, *filters, seeds, offsets, top_k=False, block=64, bitmask=bitmask)
    ref = sample_ref(logits, *filters, seeds, offsets, bitmask=bitmask)
    assert torch.equal(out.token_ids, ref.token_ids)


def test_masked_vocabulary_shard_equals_ref():
    # A tensor-parallel rank's columns: token ids vocab_start.. of the full-vocabulary mask.
    batch, vocab, start = len(SETTINGS), 160, 70
    full = distinct_logits(batch, vocab, f32, seed=15)
    bitmask = pack(random_allowed(batch, vocab, seed=7))
    filters = settings_tensors(SETTINGS)
    seeds, offsets = keys(batch)
    shard = full[:, start:]
    out = sample_fused(shard, *filters, seeds, offsets, 0, start, block=64, bitmask=bitmask)
    ref = sample_ref(shard, *filters, seeds, offsets, 0, start, bitmask=bitmask)
    assert torch.equal(out.token_ids, ref.token_ids)
    allowed = apply_bitmask_ref(full, bitmask)[:, start:].isfinite()
    assert allowed.gather(1, out.token_ids[:, None]).all()


def test_without_a_mask_nothing_changes():
    # No bitmask, every row unconstrained (-1), and an all-ones mask: the same bits.
    batch, vocab = len(SETTINGS), 160
    logits = distinct_logits(batch, vocab, bf16, seed=16)
    filters = settings_tensors(SETTINGS)
    seeds, offsets = keys(batch)
    ones = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32, device=DEVICE)
    none = torch.full((batch,), -1, dtype=torch.int32, device=DEVICE)
    base = sample_fused(logits, *filters, seeds, offsets, num_logprobs=2, block=64)
    base_ref = sample_ref(logits, *filters, seeds, offsets, num_logprobs=2)
    assert torch.equal(base.token_ids, base_ref.token_ids)
    for kw in (dict(bitmask=ones), dict(bitmask=ones, bitmask_rows=none)):
        for fn, unmasked in ((sample_fused, base), (sample_ref, base_ref)):
            extra = dict(block=64) if fn is sample_fused else {}
            out = fn(logits, *filters, seeds, offsets, num_logprobs=2, **kw, **extra)
            for name in ("token_ids", "logprobs", "top_logprobs", "top_token_ids", "scores"):
                assert torch.equal(getattr(out, name), getattr(unmasked, name)), (fn, name)
    assert torch.equal(argmax_fused(logits, 64, ones, none), argmax_fused(logits, 64))


def masked_probs(logits_row: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    return logits_row.float().masked_fill(~allowed, float("-inf")).softmax(dim=0)


# Over 16 tokens, half masked out at random; criticals are chi2 at p = 1e-4 (df <= 15).
DIST_VOCAB = 16


def dist_inputs(num: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    # Flat enough that every allowed token is expected a few times in a hundred draws.
    logits_row = (torch.randn(DIST_VOCAB, generator=gen) * 0.5).to(DEVICE)
    allowed = torch.randperm(DIST_VOCAB, generator=gen)[: DIST_VOCAB // 2]
    allowed = torch.zeros(DIST_VOCAB, dtype=torch.bool).index_fill(0, allowed, True).to(DEVICE)
    # The unmasked favourite is masked out: the draw cannot just follow the logits.
    allowed[logits_row.argmax()] = False
    allowed[logits_row.argmin()] = True
    filters = settings_tensors([(1.0, 0, 1.0, 0.0)] * num)
    seeds = torch.full((num,), 4321, dtype=torch.int64, device=DEVICE)
    offsets = torch.arange(num, dtype=torch.int64, device=DEVICE)
    bitmask = pack(allowed[None])  # every row takes this one mask row
    rows = torch.zeros(num, dtype=torch.int32, device=DEVICE)
    return logits_row, allowed, filters, seeds, offsets, bitmask, rows


def test_reference_masked_draws_match_distribution():
    # The kernel draws the reference's tokens exactly (above): the reference's frequencies
    # over 20,000 offsets stand for the kernel's.
    num = 20_000
    logits_row, allowed, filters, seeds, offsets, bitmask, rows = dist_inputs(num, seed=8)
    logits = logits_row.expand(num, -1)
    tokens = sample_ref(logits, *filters, seeds, offsets, bitmask=bitmask, bitmask_rows=rows)
    chi_square_check(tokens.token_ids, masked_probs(logits_row, allowed), critical=37.7)


@pytest.mark.parametrize("plain", [False, True])
def test_kernel_never_draws_a_masked_token(plain):
    num = 128 if DEVICE == "cpu" else 20_000  # interpreter rows are slow
    logits_row, allowed, filters, seeds, offsets, bitmask, rows = dist_inputs(num, seed=9)
    logits = logits_row.expand(num, -1)
    out = sample_fused(logits, *filters, seeds, offsets, plain=plain, bitmask=bitmask,
                       bitmask_rows=rows)  # fmt: skip
    assert allowed[out.token_ids].all()
    chi_square_check(out.token_ids, masked_probs(logits_row, allowed), critical=37.7)
