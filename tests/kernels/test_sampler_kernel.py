"""sample_fused (Triton) against sample_ref: allowed sets, tokens, noise, distribution, logprobs."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import DEVICE

from nanopaged.kernels.hash_rng import gumbel_ref, uniform_ref
from nanopaged.kernels.sampler import (
    allowed_mask_fused,
    allowed_mask_ref,
    sample_ref,
)
from nanopaged.kernels.sampler_chunks import argmax_fused, sample_fused

try:
    import triton
    import triton.language as tl

    from nanopaged.kernels.hash_rng import gumbel
except ImportError:
    triton = None

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16

if triton is not None:

    @triton.jit
    def _noise_kernel(u_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        u = tl.load(u_ptr + i, mask=i < n, other=0.5)
        tl.store(out_ptr + i, gumbel(u), mask=i < n)

# One row per setting: (temperature, top_k, top_p, min_p). Greedy, each filter alone, pairs,
# all together, and "off" spelled every way (k <= 0, k >= vocab, p = 1, min_p = 0).
SETTINGS = [
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.7, 20, 1.0, 0.0),
    (1.0, 0, 0.9, 0.0),
    (1.3, 0, 1.0, 0.05),
    (0.5, 50, 0.8, 0.0),
    (1.0, 40, 0.95, 0.02),
    (2.0, -1, 0.5, 0.1),
    (1.0, 10_000, 0.3, 0.0),
    (0.8, 1, 1.0, 0.0),
    (1.0, 0, 1e-6, 0.0),
    (0.0, 5, 0.5, 0.5),
]


def distinct_logits(batch: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[batch, vocab] logits with no ties within a row, exactly representable in dtype."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        pool = (torch.randn(8 * vocab, generator=gen) * 3).to(dtype).unique()
        assert pool.numel() >= vocab, "dtype too coarse for this vocab"
        rows.append(pool[torch.randperm(pool.numel(), generator=gen)[:vocab]])
    return torch.stack(rows).to(DEVICE)


def settings_tensors(settings, device=DEVICE):
    temps, ks, ps, min_ps = zip(*settings, strict=True)
    return (
        torch.tensor(temps, dtype=torch.float32, device=device),
        torch.tensor(ks, dtype=torch.int32, device=device),
        torch.tensor(ps, dtype=torch.float32, device=device),
        torch.tensor(min_ps, dtype=torch.float32, device=device),
    )


def keys(batch: int, seed0: int = 7, device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    seeds = torch.arange(batch, dtype=torch.int64, device=device) * 1_000_003 + seed0 - 2**40
    offsets = torch.arange(batch, dtype=torch.int64, device=device) * 3 + 2**33
    return seeds, offsets


@pytest.mark.parametrize("dtype", [f32, f16, bf16])
@pytest.mark.parametrize("vocab,block", [(200, 64), (97, 128)])
def test_allowed_set_equals_ref(dtype, vocab, block):
    logits = distinct_logits(len(SETTINGS), vocab, dtype, seed=vocab)
    filters = settings_tensors(SETTINGS)
    got = allowed_mask_fused(logits, *filters, block=block)
    ref = allowed_mask_ref(logits, *filters)
    assert torch.equal(got, ref), (got != ref).sum(dim=1)
    assert ref.sum(dim=1).min() >= 1
    # The settings must really cut: top-k alone keeps exactly k, top_p 1e-6 keeps one token.
    assert ref[2].sum() == 20 and ref[9].sum() == 1 and ref[10].sum() == 1


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_wide_rows_under_random_settings(dtype):
    # Rows many blocks wide, peaked to flat (the logits' scale), with ties in bf16, under
    # random temperatures, top-k, top-p and min-p, and five top logprobs (a value tied with
    # the fifth largest must not crowd out a larger one).
    gen = torch.Generator().manual_seed(5)
    rows, vocab = 12, 3000
    scales = torch.logspace(-1, 1, rows)
    logits = (torch.randn(rows, vocab, generator=gen) * scales[:, None]).to(dtype).to(DEVICE)
    logits[3, ::3] = float("-inf")
    temps = torch.rand(rows, generator=gen) * 1.7 + 0.3
    top_ks = torch.randint(-1, 400, (rows,), generator=gen).to(torch.int32)
    top_ks[::3] = 0
    top_ks[5], top_ks[8] = 1500, 700  # more than the lanes' two largest values can hold
    top_ps = torch.rand(rows, generator=gen) * 0.95 + 0.04
    top_ps[1::4] = 1.0
    min_ps = torch.where(torch.rand(rows, generator=gen) < 0.3, 0.01, 0.0)
    filters = tuple(t.to(DEVICE) for t in (temps, top_ks, top_ps, min_ps))
    got = allowed_mask_fused(logits, *filters, block=256)
    ref = allowed_mask_ref(logits, *filters)
    assert torch.equal(got, ref), (got != ref).sum(dim=1)
    sizes = ref.sum(dim=1)
    assert sizes.min() >= 1 and sizes.max() > 1000  # peaked and flat rows both
    seeds, offsets = keys(rows)
    out = sample_fused(logits, *filters, seeds, offsets, num_logprobs=5, block=256)
    want = sample_ref(logits, *filters, seeds, offsets, num_logprobs=5)
    assert torch.equal(out.token_ids, want.token_ids)
    # The top-5 values (bf16 rows hold ties, whose ids may come in either order).
    torch.testing.assert_close(out.top_logprobs, want.top_logprobs)


@pytest.mark.parametrize("dtype", [f32, f16, bf16])
def test_top_p_bracket_passes(dtype):
    # The top-p search's probe passes narrow a bracket whose bounds are thresholds, not row
    # values, until the dtype's spacing (bf16, f16) or the pass limit (f32) stops them. Rows
    # flat to peaked, one dominant token, a top-k inside and outside the probes' limit, and
    # p from tiny to almost 1; the kernel's set must be the reference's, and each row must
    # really cut (more than one token, fewer than all) where p allows.
    gen = torch.Generator().manual_seed(11)
    vocab, top_ps = 2500, [1e-6, 0.2, 0.6, 0.9, 0.97, 0.999]
    rows = []
    for scale in (0.3, 2.0, 6.0):
        rows.append(torch.randn(len(top_ps), vocab, generator=gen) * scale)
    logits = torch.cat(rows)
    logits[::4, 17] += 25.0  # one token holds almost all of the mass
    n = logits.shape[0]
    temps = torch.full((n,), 0.9)
    top_ks = torch.zeros(n, dtype=torch.int32)
    top_ks[1::5], top_ks[2::5] = 50, 900  # inside the small-k limit, and above it
    ps = torch.tensor(top_ps * 3)
    filters = tuple(t.to(DEVICE) for t in (temps, top_ks, ps, torch.zeros(n)))
    logits = logits.to(dtype).to(DEVICE)
    got = allowed_mask_fused(logits, *filters, block=256)
    ref = allowed_mask_ref(logits, *filters)
    assert torch.equal(got, ref), (got != ref).sum(dim=1)
    sizes = ref.sum(dim=1)
    assert sizes.min() >= 1 and (sizes[ps.to(DEVICE) > 0.5] > 1).any()
    assert (sizes < vocab).all() and sizes.max() > 500


def test_ties_share_their_fate():
    # Logits on a 0.25 grid: many ties at every cut-off; a tied group is kept or dropped whole.
    gen = torch.Generator().manual_seed(2)
    logits = ((torch.randn(len(SETTINGS), 150, generator=gen) * 2) * 4).round() / 4
    logits = logits.to(DEVICE)
    filters = settings_tensors(SETTINGS)
    got = allowed_mask_fused(logits, *filters, block=64)
    ref = allowed_mask_ref(logits, *filters)
    assert torch.equal(got, ref), (got != ref).sum(dim=1)
    for row in range(len(SETTINGS)):
        kept = logits[row][ref[row]]
        assert not (logits[row][~ref[row]] == kept.min()).any()


def test_strided_rows_and_masked_tokens():
    # Rows of a wider buffer (as logits_indices leave them), with -inf tokens (min_tokens).
    base = distinct_logits(len(SETTINGS), 150, f32, seed=3)
    wide = torch.zeros(len(SETTINGS), 170, device=DEVICE)
    wide[:, 10:160] = base
    logits = wide[:, 10:160]
    logits[:, ::7] = float("-inf")
    filters = settings_tensors(SETTINGS)
    got = allowed_mask_fused(logits, *filters, block=64)
    ref = allowed_mask_ref(logits, *filters)
    assert torch.equal(got, ref)
    assert not got[:, ::7].any()
    out = sample_fused(logits, *filters, *keys(len(SETTINGS)), block=64)
    assert not (out.token_ids % 7 == 0).any()


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_tokens_and_logprobs_equal_ref(dtype):
    logits = distinct_logits(len(SETTINGS), 160, dtype, seed=11)
    filters = settings_tensors(SETTINGS)
    seeds, offsets = keys(len(SETTINGS))
    out = sample_fused(logits, *filters, seeds, offsets, num_logprobs=5, block=64)
    ref = sample_ref(logits, *filters, seeds, offsets, num_logprobs=5)
    assert torch.equal(out.token_ids, ref.token_ids)
    greedy = filters[0] == 0
    assert torch.equal(out.token_ids[greedy], logits.float().argmax(dim=1)[greedy])
    allowed = allowed_mask_ref(logits, *filters)
    assert allowed.gather(1, out.token_ids[:, None]).all()
    raw = logits.float().log_softmax(dim=1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])
    top, top_ids = raw.topk(5, dim=1)
    torch.testing.assert_close(out.top_logprobs, top)
    assert torch.equal(out.top_token_ids, top_ids)
    # The count of top logprobs is a runtime argument of one compiled variant: any count.
    for n in (1, 3, 17):
        out_n = sample_fused(logits, *filters, seeds, offsets, num_logprobs=n, block=64)
        assert torch.equal(out_n.token_ids, ref.token_ids)
        top, top_ids = raw.topk(n, dim=1)
        torch.testing.assert_close(out_n.top_logprobs, top)
        assert torch.equal(out_n.top_token_ids, top_ids)
    # Without logprobs: the same tokens, and no logprob made up for them.
    for fn in (sample_fused, sample_ref):
        kw = dict(block=64) if fn is sample_fused else {}
        bare = fn(logits, *filters, seeds, offsets, logprobs=False, **kw)
        assert torch.equal(bare.token_ids, ref.token_ids) and bare.logprobs is None


@pytest.mark.parametrize("dtype", [f32, f16, bf16])
@pytest.mark.parametrize("vocab,block", [(300, 64), (256, 64), (37, 64), (1000, 128)])
def test_argmax_equals_torch(dtype, vocab, block):
    """argmax_fused is argmax: the first of tied maxima (within a chunk and across chunks), the
    first NaN, 0 for a row of -inf, +inf at the last column, strided rows, one row and none."""
    gen = torch.Generator().manual_seed(vocab)
    wide = torch.randn(7, vocab + 9, generator=gen).to(dtype)
    logits = wide[:, :vocab]  # rows strided past the vocabulary
    logits[1, [3, min(block + 3, vocab - 1), vocab - 1]] = 50.0
    logits[2, [1, 2]] = 60.0
    logits[3, [vocab // 2, vocab - 2]] = float("nan")
    logits[3, 0] = float("inf")
    logits[4] = float("-inf")
    logits[5, vocab - 1] = float("inf")
    logits[6, -1] = float("nan")
    logits = logits.to(DEVICE)
    expected = logits.float().cpu().argmax(dim=-1)
    assert expected[1] == 3 and expected[2] == 1 and expected[4] == 0  # argmax's own rule
    assert torch.equal(argmax_fused(logits, block=block).cpu(), expected)
    assert torch.equal(argmax_fused(logits[4:5], block=block).cpu(), expected[4:5])
    assert argmax_fused(logits[:0], block=block).shape == (0,)


# Temperature alone (greedy included): the settings whose rows can be sampled by shards.
PLAIN = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.5, 0, 1.0, 0.0),
         (0.3, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0)]  # fmt: skip


@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("cuts", [(0, 70, 160), (0, 53, 106, 159, 160)])
def test_vocabulary_shards_give_the_full_rows_token(dtype, cuts):
    from nanopaged.sampling.sharded import pick_across_shards

    logits = distinct_logits(len(PLAIN), 160, dtype, seed=3)
    # The last row's maximum twice, in two shards: greedy takes the first, as argmax does.
    logits[-1, 100] = logits[-1, 10] = logits[-1].max() + 1
    filters = settings_tensors(PLAIN)
    seeds, offsets = keys(len(PLAIN))
    full = sample_fused(logits, *filters, seeds, offsets, block=64)
    full_ref = sample_ref(logits, *filters, seeds, offsets)
    assert torch.equal(full.token_ids, full_ref.token_ids) and full.token_ids[-1] == 10
    torch.testing.assert_close(full.scores, full_ref.scores)
    for how in ("fused", "plain", "ref"):
        scores, tokens = [], []
        for a, b in zip(cuts, cuts[1:]):
            shard = logits[:, a:b]  # strided rows, as a rank's slice of the LM head output
            if how == "ref":
                out = sample_ref(shard, *filters, seeds, offsets, vocab_start=a)
            else:
                out = sample_fused(shard, *filters, seeds, offsets, vocab_start=a, block=64,
                                   logprobs=how == "fused", plain=how == "plain")
            scores.append(out.scores)
            tokens.append(out.token_ids + a)
        got = pick_across_shards(torch.stack(scores), torch.stack(tokens))
        assert torch.equal(got, full.token_ids), how
        want = full_ref.scores if how == "ref" else full.scores
        assert torch.equal(torch.stack(scores).amax(dim=0), want), how


@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("vocab,block", [(300, 64), (37, 128)])
@pytest.mark.parametrize("num_logprobs,logprobs", [(0, False), (0, True), (3, False)])
def test_plain_rows_drawn_in_chunks(dtype, vocab, block, num_logprobs, logprobs):
    # plain=True (no top-k or top-p) draws each row in chunks side by side: the full kernel's
    # tokens and scores exactly, its logprobs and top logprobs within rounding, and the
    # reference's tokens, whatever the chunk boundaries; with greedy rows (first maximum, a
    # tie across chunks), min-p rows, -inf tokens, a row all -inf, strided rows.
    gen = torch.Generator().manual_seed(vocab)
    settings = [*PLAIN, (0.9, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.05), (0.7, 0, 1.0, 0.3),
                (1.5, 0, 1.0, 0.0)]  # fmt: skip
    rows = len(settings)
    wide = (torch.randn(rows, vocab + 3, generator=gen) * 3).to(dtype).to(DEVICE)
    logits = wide[:, :vocab]
    logits[0, vocab // 3] = logits[0, vocab - 1] = logits[0].max() + 1
    logits[2, ::3] = float("-inf")
    logits[-1] = float("-inf")
    # One token above min-p's cut (at 0.7, x - x_max = -1.5 < log 0.3), many just under it.
    cut_row = len(PLAIN) + 2
    logits[cut_row] = -1.05
    logits[cut_row, 5] = 0.0
    filters = settings_tensors(settings)
    seeds, offsets = keys(rows)

    def chunked(logits, filters, seeds, offsets, min_p=True):
        return sample_fused(logits, *filters, seeds, offsets, num_logprobs, block=block,
                            logprobs=logprobs, plain=True, min_p=min_p)  # fmt: skip

    got = chunked(logits, filters, seeds, offsets)
    full = sample_fused(logits, *filters, seeds, offsets, num_logprobs, block=block)
    ref = sample_ref(logits, *filters, seeds, offsets, num_logprobs)
    assert torch.equal(got.token_ids, full.token_ids)
    assert torch.equal(got.scores, full.scores)
    assert torch.equal(got.token_ids, ref.token_ids)
    torch.testing.assert_close(got.scores, ref.scores)
    assert got.token_ids[0] == vocab // 3 and got.token_ids[-1] == 0
    if logprobs or num_logprobs:
        finite = torch.arange(rows) != rows - 1  # the -inf row's logprobs are NaN
        torch.testing.assert_close(got.logprobs[finite], full.logprobs[finite])
    else:
        assert got.logprobs is None
    if num_logprobs:
        assert torch.equal(got.top_token_ids[finite], full.top_token_ids[finite])
        torch.testing.assert_close(got.top_logprobs[finite], full.top_logprobs[finite])
        torch.testing.assert_close(got.top_logprobs[finite], ref.top_logprobs[finite])
    if num_logprobs or logprobs:
        return  # the draws below do not depend on logprobs
    # The draws below take only the rows they check, still strided (a row's draw depends on its
    # own logits, settings, seed and offset): the two greedy rows, a sampled one, the min-p rows.
    keep = [0, len(PLAIN) - 1, 1, len(PLAIN) + 1, cut_row]
    sub = (wide[keep][:, :vocab], tuple(f[keep] for f in filters), seeds[keep])
    r, cut = 3, 4  # the min-p rows' places in `keep`
    # min-p cuts: the rows with it never draw a token under its cut, and without the cut
    # (min_p=False: the caller said no row has min-p) they would have.
    x = sub[0].float() / sub[1][0].clamp(min=1e-6)[:, None]
    draws = torch.stack([chunked(*sub, offsets[keep] + i).token_ids for i in range(8)])
    assert (x[r][draws[:, r]] >= x[r].max() + torch.log(sub[1][3][r]) - 1e-5).all()
    assert (draws[:, cut] == 5).all()
    uncut = torch.stack([chunked(*sub, offsets[keep] + i, min_p=False).token_ids
                         for i in range(8)])  # fmt: skip
    assert (uncut[:, cut] != 5).any()
    # The noise moves the draws: over a few output positions a sampled row takes several
    # tokens, a greedy row one.
    distinct = torch.tensor([len(set(col.tolist())) for col in draws.T])
    assert distinct[0] == distinct[1] == 1 and distinct.max() > 1


@pytest.mark.parametrize(
    "dtype,vocab,block,frontier,logprobs",
    [(f32, 200, 64, (16, 32), False), (bf16, 200, 64, (16, 32), True),
     (bf16, 200, 64, (2, 3), False), (f32, 200, 64, (1, 1), True),
     (f32, 45, 128, (16, 32), False)],
)  # fmt: skip
def test_top_p_rows_drawn_in_chunks(dtype, vocab, block, frontier, logprobs):
    # top_k=False (no row has top-k) draws rows with top-p, min-p or temperature alone in
    # chunks, from the masses above each row's few candidates: the full kernel's tokens and
    # scores exactly, its logprobs within rounding, the reference's tokens. Rows peaked to
    # flat (many candidates), greedy (a tie across chunks), -inf tokens, a sampled row all
    # -inf, top-p keeping one token, top-p with min-p, strided rows. Tiny frontier caps make
    # rows whose candidates run out fall back to the full walk.
    gen = torch.Generator().manual_seed(vocab + block)
    rows = 20
    scales = torch.logspace(-1.5, 1, rows)
    wide = (torch.randn(rows, vocab + 5, generator=gen) * scales[:, None]).to(dtype)
    logits = wide.to(DEVICE)[:, :vocab]
    logits[0, vocab // 4] = logits[0, vocab - 2] = logits[0].max() + 1
    logits[3, ::3] = float("-inf")
    logits[4] = float("-inf")
    temps = torch.rand(rows, generator=gen) * 1.7 + 0.3
    temps[0] = temps[9] = 0.0
    top_ps = torch.rand(rows, generator=gen) * 0.95 + 0.04
    top_ps[1::5] = 1.0
    top_ps[5] = 1e-6
    min_ps = torch.where(torch.rand(rows, generator=gen) < 0.3, 0.05, 0.0)
    min_ps[6] = 0.2
    filters = (temps.to(DEVICE), torch.zeros(rows, dtype=torch.int32, device=DEVICE),
               top_ps.to(DEVICE), min_ps.to(DEVICE))  # fmt: skip
    seeds, offsets = keys(rows)
    got = sample_fused(logits, *filters, seeds, offsets, block=block, logprobs=logprobs,
                       top_k=False, frontier=frontier)  # fmt: skip
    full = sample_fused(logits, *filters, seeds, offsets, block=block, logprobs=logprobs)
    ref = sample_ref(logits, *filters, seeds, offsets)
    assert torch.equal(got.token_ids, full.token_ids)
    assert torch.equal(got.scores, full.scores)
    assert torch.equal(got.token_ids, ref.token_ids)
    assert got.token_ids[0] == vocab // 4 and got.token_ids[4] == 0
    if logprobs:
        finite = torch.arange(rows) != 4  # the -inf row's logprobs are NaN
        torch.testing.assert_close(got.logprobs[finite], full.logprobs[finite])
    else:
        assert got.logprobs is None
    # The cuts matter: on some rows the best score of all finite tokens is cut, so the token
    # is a later candidate (past a cap of one, the full walk's).
    uncut = sample_ref(logits, filters[0], filters[1], torch.ones_like(filters[2]),
                       torch.zeros_like(filters[3]), seeds, offsets).token_ids
    assert (uncut != ref.token_ids).sum() >= 3


@pytest.mark.parametrize("num_logprobs", [1, 4, 9])
def test_chunked_top_logprobs(num_logprobs):
    # The chunked draw's top logprobs (each chunk searches only when it holds a value at least
    # the n-th largest of the chunks' maxima) against a stable descending sort: the largest
    # values all in one chunk, ties at the n-th value across chunks (the lowest token ids
    # first), a row with fewer finite values than n.
    vocab, block = 400, 64
    gen = torch.Generator().manual_seed(num_logprobs)
    logits = torch.randn(4, vocab, generator=gen).to(DEVICE)
    logits[0, 130:140] = torch.arange(10, device=DEVICE) + 10.0  # one chunk holds the top 10
    logits[1, [5, 70, 200, 333, 399]] = 7.0  # five equal largest values in five chunks
    logits[1, [64, 300]] = 6.0
    logits[2] = float("-inf")
    logits[2, [3, 250]] = 1.0
    filters = settings_tensors([(1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (0.8, 0, 1.0, 0.0),
                                (1.2, 0, 1.0, 0.0)])  # fmt: skip
    seeds, offsets = keys(4)
    got = sample_fused(logits, *filters, seeds, offsets, num_logprobs, block=block, plain=True)
    lp = logits.float().log_softmax(dim=1)
    want, order = lp.sort(dim=1, descending=True, stable=True)
    ids = order[:, :num_logprobs]
    ids[2, 2:] = 0  # slots past the finite values: -inf, token 0
    assert torch.equal(got.top_token_ids, ids)
    torch.testing.assert_close(got.top_logprobs, want[:, :num_logprobs])


def test_rows_independent_and_reproducible():
    settings = [(1.0, 0, 1.0, 0.0), (0.9, 30, 0.9, 0.0), (1.5, 0, 0.95, 0.01)]
    logits = distinct_logits(3, 100, f32, seed=5)
    filters = settings_tensors(settings)
    seeds, offsets = keys(3)
    batch = sample_fused(logits, *filters, seeds, offsets, block=64).token_ids
    again = sample_fused(logits, *filters, seeds, offsets, block=64).token_ids
    assert torch.equal(batch, again)
    # Row 1 alone, and row 1 with its neighbours shuffled around it: the same token.
    alone = sample_fused(logits[1:2], *(t[1:2] for t in filters), seeds[1:2], offsets[1:2],
                         block=64).token_ids
    perm = torch.tensor([2, 1, 0], device=DEVICE)
    mixed = sample_fused(logits[perm], *(t[perm] for t in filters), seeds[perm], offsets[perm],
                         block=64).token_ids
    assert alone.item() == batch[1].item() == mixed[1].item()
    assert torch.equal(mixed[perm], batch)


def test_gumbel_noise_is_accurate():
    # The kernels' noise -log(-log(u)) over the hash's own grid of u ((k + 1/2) 2^-23): the
    # smallest and largest u, both sides of 1/2 (where it switches from the log to the atanh
    # series) and a random sample, against float64.
    if triton is None:
        pytest.skip("needs triton")
    gen = torch.Generator().manual_seed(0)
    top = 2**23
    k = torch.cat([torch.arange(2000), torch.arange(top - 2000, top),
                   torch.arange(top // 2 - 2000, top // 2 + 2000),
                   torch.randint(0, top, (50_000,), generator=gen)])  # fmt: skip
    u = (k.double() + 0.5) * 2.0**-23
    exact = -torch.log(-torch.log(u))
    u32 = u.float().to(DEVICE)
    got = torch.empty_like(u32)
    _noise_kernel[(triton.cdiv(len(k), 1024),)](u32, got, len(k), BLOCK=1024)
    err = (got.double().cpu() - exact).abs()
    bound = 4e-7 + 2.0**-22 * exact.abs()  # a few ulps of fp32 results up to 16.6
    assert (err <= bound).all(), (err.max().item(), u[err.argmax()].item())
    assert (gumbel_ref(u.float()).double() - exact).abs().le(bound).all()


def test_noise_depends_on_seed_and_offset_only():
    seeds = torch.tensor([1, 1, 2, -1], dtype=torch.int64)
    offsets = torch.tensor([5, 6, 5, 5], dtype=torch.int64)
    u = uniform_ref(seeds, offsets, 4096)
    assert u.min() > 0 and u.max() < 1
    # Different keys give unrelated streams; each stream looks uniform.
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert not torch.equal(u[0], u[3])
    assert (u.mean(dim=1) - 0.5).abs().max() < 0.02
    assert torch.equal(uniform_ref(seeds[2:3], offsets[2:3], 4096)[0], u[2])


def chi_square_check(tokens: torch.Tensor, probs: torch.Tensor, critical: float) -> None:
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    expected = probs.double().cpu() * tokens.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token outside the allowed set"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    assert stat < critical, stat


def filtered_probs(logits_row: torch.Tensor, setting) -> torch.Tensor:
    filters = settings_tensors([setting], device=logits_row.device)
    allowed = allowed_mask_ref(logits_row[None], *filters)[0]
    x = logits_row.float() / setting[0]
    return x.masked_fill(~allowed, float("-inf")).softmax(dim=0)


# (temperature, top_k, top_p, min_p) over 10 tokens; criticals are chi2 at p = 1e-4.
DIST_SETTINGS = [(1.0, 0, 1.0, 0.0), (0.7, 6, 0.9, 0.0), (1.5, 0, 0.8, 0.05)]


@pytest.mark.parametrize("setting", DIST_SETTINGS)
def test_reference_draws_match_distribution(setting):
    # The kernel draws the reference's tokens exactly (tests above), so the reference's
    # frequencies stand for the kernel's; here over 20,000 offsets of one seed.
    num = 20_000
    logits_row = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.1, -0.3, -0.8, -1.5, -2.5])
    probs = filtered_probs(logits_row, setting)
    filters = settings_tensors([setting] * num, device="cpu")
    offsets = torch.arange(num, dtype=torch.int64)
    seeds = torch.full((num,), 1234, dtype=torch.int64)
    tokens = sample_ref(logits_row.expand(num, -1), *filters, seeds, offsets).token_ids
    chi_square_check(tokens, probs, critical=33.7)  # df <= 9


def test_kernel_draws_match_distribution_small():
    # A hundred interpreter rows: a coarse check of the kernel's own draws.
    num = 100
    logits_row = torch.tensor([1.0, 0.5, 0.0, -0.5], device=DEVICE)
    setting = (1.0, 0, 1.0, 0.0)
    filters = settings_tensors([setting] * num)
    offsets = torch.arange(num, dtype=torch.int64, device=DEVICE)
    seeds = torch.full((num,), 99, dtype=torch.int64, device=DEVICE)
    tokens = sample_fused(logits_row.expand(num, -1), *filters, seeds, offsets).token_ids
    chi_square_check(tokens, filtered_probs(logits_row, setting), critical=21.1)  # df 3


def test_refs_import_without_triton():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from nanopaged.kernels import hash_rng, sampler\n"
        "assert sampler.triton is None and hash_rng.triton is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- GPU: the real vocabulary size ------------------------------------------------------


def gpu_logits(batch: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    return (torch.randn(batch, vocab, device=DEVICE, generator=gen) * 4).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bf16, f16, f32])
def test_gpu_allowed_set_large_vocab(dtype):
    # bf16 logits of a 152k vocabulary hold ties, and fp32 sums run in different orders, so a
    # row may differ from the reference only at its cut-off: by tied or borderline tokens.
    vocab = 151_936
    settings = SETTINGS * 4
    logits = gpu_logits(len(settings), vocab, dtype)
    filters = settings_tensors(settings)
    got = allowed_mask_fused(logits, *filters)
    ref = allowed_mask_ref(logits, *filters)
    diff = (got != ref).sum(dim=1)
    assert (diff == 0).float().mean() > 0.9, diff
    assert (diff <= ref.sum(dim=1) // 100 + 2).all(), diff


@pytest.mark.gpu
def test_gpu_tokens_equal_ref():
    vocab = 151_936
    settings = SETTINGS * 8
    logits = gpu_logits(len(settings), vocab, f32)
    filters = settings_tensors(settings)
    seeds, offsets = keys(len(settings))
    out = sample_fused(logits, *filters, seeds, offsets, num_logprobs=5)
    ref = sample_ref(logits, *filters, seeds, offsets, num_logprobs=5)
    assert (out.token_ids == ref.token_ids).float().mean() > 0.95
    torch.testing.assert_close(out.top_logprobs, ref.top_logprobs)
    torch.testing.assert_close(out.logprobs, ref.logprobs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bf16, f32])
def test_gpu_top_p_chunked_equals_full(dtype):
    # The chunked draw for rows without top-k (top_k=False) at the real vocabulary: the full
    # kernel's tokens and scores. Their softmax sums run in different orders, so a row whose
    # cut falls within rounding of a token's mass may differ: allowed in one row of fifty.
    vocab = 151_936
    settings = [s for s in SETTINGS if s[1] <= 0 or s[1] >= vocab] * 12
    logits = gpu_logits(len(settings), vocab, dtype)
    logits[1::7] *= 0.05  # flat rows: long frontiers
    filters = settings_tensors(settings)
    seeds, offsets = keys(len(settings))
    full = sample_fused(logits, *filters, seeds, offsets)
    chunked = sample_fused(logits, *filters, seeds, offsets, top_k=False)
    same = full.token_ids == chunked.token_ids
    assert same.float().mean() >= 0.98, same
    assert torch.equal(full.scores[same], chunked.scores[same])


@pytest.mark.gpu
@pytest.mark.parametrize("setting", DIST_SETTINGS)
def test_gpu_kernel_draws_match_distribution(setting):
    num = 50_000
    logits_row = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.1, -0.3, -0.8, -1.5, -2.5],
                              device=DEVICE)
    filters = settings_tensors([setting] * num)
    offsets = torch.arange(num, dtype=torch.int64, device=DEVICE)
    seeds = torch.full((num,), 4321, dtype=torch.int64, device=DEVICE)
    tokens = sample_fused(logits_row.expand(num, -1), *filters, seeds, offsets).token_ids
    chi_square_check(tokens, filtered_probs(logits_row, setting), critical=33.7)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    # Settings and seeds live on the device: change them in place and replay.
    logits = gpu_logits(8, 151_936, bf16)
    filters = settings_tensors(SETTINGS[:8])
    seeds, offsets = keys(8)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sample_fused(logits, *filters, seeds, offsets, num_logprobs=3)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample_fused(logits, *filters, seeds, offsets, num_logprobs=3)
    for step in range(3):
        offsets.add_(1)
        graph.replay()
        ref = sample_fused(logits, *filters, seeds, offsets, num_logprobs=3)
        assert torch.equal(out.token_ids, ref.token_ids), step
