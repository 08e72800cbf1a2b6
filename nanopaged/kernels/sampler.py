"""Fused sort-free sampling: temperature, top-k, top-p, min-p, seeded noise, raw logprobs.

Semantics, per row of logits [batch, vocab], all in fp32 on x = logits * (1 / temperature)
(the reciprocal and the product each rounded to fp32; within an ulp of logits / temperature):
  greedy (temperature == 0): the first argmax of the raw logits.
  top-k (1 <= k < vocab): keep x >= the k-th largest x (tied tokens share the fate).
  top-p (< 1): over the top-k set, with e = exp(x - max x) and Z = sum of e over that set,
      drop a token when the e of the tokens with strictly greater x sums to more than top_p * Z.
  min-p (> 0): drop a token when x - max x < log(min_p), i.e. p < min_p * p_max.
  sample: argmax over the allowed tokens of x + g, g = -log(-log(u)) Gumbel noise (within
      4e-7: hash_rng.gumbel), u from a counter-based hash of (seed, offset, token index): a
      row's token depends only on its logits, settings, seed and offset, never on the batch.
Logprobs are log_softmax of the logits passed in, before temperature (vLLM's raw logprobs).
A bitmask (structured outputs) sets the tokens it clears to -inf as the row is loaded, before
all of the above: a constrained row's logprobs are those of the masked distribution.
min_tokens is the caller's: it sets a banned stop token's logit to -inf (a -inf token is never
allowed). Penalties are the caller's too: sampling/penalties.penalize applies them first
(kernels/penalties.py, one pass over the penalized rows), and then the logprobs are of the
penalized logits, where vLLM's are of the logits before penalties (so penalties with logprobs
take the synchronous path, which keeps the raw row).

Every cut-off is a threshold on x found by a search over the values, one pass over the row per
step, so nothing is sorted; each step keeps its bounds on actual element values, so the search
ends on the exact threshold rather than near it. The k-th largest search starts from the k-th
largest of each lane's two largest values (found in registers after the first pass); the top-p
search first brackets the cut with passes that sum the mass above four thresholds at once
(each narrows the bracket five-fold, no per-value bookkeeping), then alternates halving with
interpolating the mass between its bounds until they meet on a value. The searches run on
the raw logits (a rounded product with a positive 1 / temperature keeps their order), so the
kernel can differ from the reference only where two raw values round to one x, or where a
token's mass sits within fp32 summation error of top_p * Z.

Rows without top-k need no search at all: sample_fused(plain=True) and sample_fused(top_k=False)
draw them in chunks of the row side by side, with the same bits per token as the full kernel
(kernels/sampler_chunks.py, which also holds argmax_fused).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanopaged.kernels.hash_rng import gumbel_ref, uniform_ref
from nanopaged.kernels.paged_decode import num_sms

try:
    import triton
    import triton.language as tl

    from nanopaged.kernels.hash_rng import noisy_score, row_keys, scaled, uniform
except ImportError:  # CPU-only installs use sample_ref
    triton = None


@dataclass
class FusedSample:
    """Tokens of one sampling step and, when asked for, their raw logprobs."""

    token_ids: torch.Tensor  # [batch] int64
    logprobs: torch.Tensor | None  # [batch] fp32, the sampled token's raw logprob
    top_logprobs: torch.Tensor | None  # [batch, num_logprobs] fp32, descending
    top_token_ids: torch.Tensor | None  # [batch, num_logprobs] int64
    # [batch] fp32, what the token won with: x + noise of a sampled row, the raw maximum of
    # a greedy one. Over shards of a vocabulary the largest (first on ties) is the full row's.
    scores: torch.Tensor | None = None


# ---- the reference ----------------------------------------------------------------------


def allowed_mask_ref(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
) -> torch.Tensor:
    """[batch, vocab] bool: the tokens a sampled row may draw (greedy rows: all finite)."""
    vocab = logits.shape[1]
    greedy = temperatures == 0
    temps = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    # A greedy row ignores its filters: it may take any finite token.
    top_ks = top_ks.masked_fill(greedy, 0)
    top_ps = top_ps.masked_fill(greedy, 1.0)
    min_ps = min_ps.masked_fill(greedy, 0.0)
    x = logits.float() * (1.0 / temps.float())[:, None]
    allowed = x > float("-inf")
    m = x.max(dim=1, keepdim=True).values
    ks = top_ks.long()
    use_k = (ks > 0) & (ks < vocab)
    # The filters a batch does not use are skipped whole (the CPU path runs this every step).
    if bool(use_k.any()):
        kth = x.topk(int(ks[use_k].max()), dim=1).values.gather(
            1, (ks.clamp(1, vocab) - 1).clamp(max=int(ks[use_k].max()) - 1)[:, None]
        )
        allowed &= ~use_k[:, None] | (x >= kth)
    if bool((top_ps < 1).any()):
        # F(token) = sum of e over allowed tokens with strictly greater x, ties counted
        # together.
        e = torch.where(allowed, torch.exp(x - m), torch.zeros_like(x))
        asc, order = x.masked_fill(~allowed, float("-inf")).sort(dim=1)
        suffix = e.gather(1, order).flip(1).cumsum(1).flip(1)  # suffix[j]: e of asc[j:]
        suffix = torch.cat([suffix, torch.zeros_like(suffix[:, :1])], dim=1)
        mass_above = suffix.gather(1, torch.searchsorted(asc, x, right=True))
        limit = top_ps.float()[:, None] * e.sum(dim=1, keepdim=True)
        allowed &= (top_ps[:, None] >= 1) | (mass_above <= limit)
    if bool((min_ps > 0).any()):
        allowed &= x - m >= torch.log(min_ps.float())[:, None]
    return allowed


def check_bitmask(
    bitmask: torch.Tensor,
    bitmask_rows: torch.Tensor | None,
    batch: int,
    vocab: int,
    vocab_start: int,
    device: torch.device,
) -> torch.Tensor:
    """The [batch] int32 bitmask row of each logits row (bitmask_rows, or row i -> i when
    None) once bitmask's layout is checked: int32 [num_masks, words] on device, words covering
    the token ids vocab_start + vocab - 1."""
    assert bitmask.dim() == 2 and bitmask.dtype == torch.int32, (bitmask.shape, bitmask.dtype)
    assert bitmask.stride(1) == 1 and bitmask.device == device, (bitmask.stride(), device)
    assert 32 * bitmask.shape[1] >= vocab_start + vocab, (bitmask.shape, vocab_start, vocab)
    if bitmask_rows is None:
        assert bitmask.shape[0] >= batch, (bitmask.shape, batch)
        return torch.arange(batch, dtype=torch.int32, device=device)
    assert bitmask_rows.shape == (batch,) and bitmask_rows.dtype == torch.int32, (
        bitmask_rows.shape, bitmask_rows.dtype,
    )  # fmt: skip
    assert bitmask_rows.is_contiguous() and bitmask_rows.device == device
    return bitmask_rows


def apply_bitmask_ref(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    bitmask_rows: torch.Tensor | None = None,
    vocab_start: int = 0,
) -> torch.Tensor:
    """logits [batch, vocab] with -inf where a row's bitmask clears its token's bit (a new
    tensor, logits' dtype). bitmask: int32 [num_masks, ceil(vocab_size / 32)], bit t % 32 of
    word t // 32 set = token id t allowed; column j is token id vocab_start + j; row i takes
    bitmask row bitmask_rows[i] (-1: no mask), or row i when bitmask_rows is None."""
    batch, vocab = logits.shape
    rows = check_bitmask(bitmask, bitmask_rows, batch, vocab, vocab_start, logits.device)
    constrained = (rows >= 0).nonzero().flatten()
    if len(constrained) == 0:
        return logits.clone()
    # Only the constrained rows unpack their words (this is the CPU path's mask).
    bits = torch.ones(32, dtype=torch.int32, device=logits.device) << torch.arange(
        32, dtype=torch.int32, device=logits.device
    )  # 1 << 31 is the sign bit
    words = bitmask[rows[constrained].long()]  # [constrained, num_words]
    # keep: [constrained, vocab], bit t % 32 of word t // 32 for token t = vocab_start + j
    keep = ((words[:, :, None] & bits) != 0).flatten(1)[:, vocab_start : vocab_start + vocab]
    if len(constrained) == batch:  # every row: no gather and scatter of rows
        return logits.masked_fill(~keep, float("-inf"))
    out = logits.clone()
    out[constrained] = logits[constrained].masked_fill(~keep, float("-inf"))
    return out


# Columns per chunk of argmax_ref's two-level search.
ARGMAX_CHUNK = 128


def argmax_ref(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None = None,
    bitmask_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [batch, vocab] -> logits.argmax(dim=-1): each row's first maximum (a NaN counts as
    the maximum, as in argmax); with a bitmask, that of apply_bitmask_ref(logits, ...).

    On CPU, torch's argmax walks a row an element at a time (1.3 ms for 16 rows of 49,152 on 2
    threads); the first ARGMAX_CHUNK-column chunk holding the row's maximum (a vectorized amax
    per chunk) and the first maximum inside it give the same index in a fifth of that.
    """
    if bitmask is not None:
        logits = apply_bitmask_ref(logits, bitmask, bitmask_rows)
    batch, vocab = logits.shape
    if vocab % ARGMAX_CHUNK or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    # chunks: [batch, vocab / ARGMAX_CHUNK, ARGMAX_CHUNK]
    chunks = logits.view(batch, vocab // ARGMAX_CHUNK, ARGMAX_CHUNK)
    best = chunks.amax(dim=-1).argmax(dim=-1)
    picked = best.view(batch, 1, 1).expand(batch, 1, ARGMAX_CHUNK)
    inside = chunks.gather(1, picked).view(batch, ARGMAX_CHUNK).argmax(dim=-1)
    return best * ARGMAX_CHUNK + inside


def sample_ref(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    num_logprobs: int = 0,
    vocab_start: int = 0,
    *,
    logprobs: bool = True,
    plain: bool = False,
    min_p: bool = True,
    top_k: bool = True,
    frontier: tuple[int, int] | None = None,
    bitmask: torch.Tensor | None = None,
    bitmask_rows: torch.Tensor | None = None,
) -> FusedSample:
    """Torch reference of sample_fused (same arguments, same tokens and scores; plain, min_p
    and top_k, promises about the rows' filters, and frontier change nothing here)."""
    if bitmask is not None:
        logits = apply_bitmask_ref(logits, bitmask, bitmask_rows, vocab_start)
    raw = logits.float()
    greedy = raw.argmax(dim=1)
    scores = raw.gather(1, greedy[:, None])[:, 0]
    temps = torch.where(temperatures == 0, torch.ones_like(temperatures), temperatures)
    x = raw * (1.0 / temps.float())[:, None]
    tokens = greedy
    rows = (temperatures != 0).nonzero().flatten()
    if len(rows):  # noise only for the rows that sample (the CPU path runs this every step)
        sub = (logits[rows], temperatures[rows], top_ks[rows], top_ps[rows], min_ps[rows])
        allowed = allowed_mask_ref(*sub)
        u = uniform_ref(seeds[rows], offsets[rows], raw.shape[1], vocab_start)
        noisy = torch.where(allowed, x[rows] + gumbel_ref(u), float("-inf"))
        sampled = noisy.argmax(dim=1)
        tokens = greedy.index_copy(0, rows, sampled)
        scores = scores.index_copy(0, rows, noisy.gather(1, sampled[:, None])[:, 0])
    if not (logprobs or num_logprobs):
        return FusedSample(tokens, None, None, None, scores)
    raw_logprobs = raw.log_softmax(dim=1)
    top_lp = top_ids = None
    if num_logprobs > 0:
        top_lp, top_ids = raw_logprobs.topk(num_logprobs, dim=1)
    picked = raw_logprobs.gather(1, tokens[:, None])[:, 0]
    return FusedSample(tokens, picked, top_lp, top_ids, scores)


# ---- the kernel -------------------------------------------------------------------------

if triton is not None:

    # Every pass over a row loads the next block before it works on this one (the loads are
    # only waited for at their first use), so two blocks are in flight instead of one: the
    # search passes got ~10% faster on an H200 (top-p 0.74 -> 0.67 ms at 256 rows); the
    # two-pass settings, bound by the last pass's arithmetic, did not move.

    @triton.jit
    def _bitmask_keep(bits_ptr, mask_cols, bit_start, idx):
        # Whether the row's bitmask allows columns idx (token ids bit_start + idx: bit t % 32
        # of word t // 32). Words are loaded for columns below mask_cols only: the row's
        # vocab, or 0 for a row without a mask, which reads no words and keeps everything.
        token = idx + bit_start
        words = tl.load(bits_ptr + token // 32, mask=idx < mask_cols, other=-1)
        return ((words >> (token % 32)) & 1) != 0

    @triton.jit
    def _load_block(row_ptr, bits_ptr, mask_cols, bit_start, start, vocab, BLOCK: tl.constexpr,
                    BITMASK: tl.constexpr):
        # The logits' own dtype (converting would wait for the load); -inf past the vocabulary
        # and, with BITMASK, where the row's bitmask clears the token's bit.
        idx = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf"))
        if BITMASK:
            x = tl.where(_bitmask_keep(bits_ptr, mask_cols, bit_start, idx), x, float("-inf"))
        return x

    @triton.jit
    def _kth_step(count, above, below, k, lo, hi):
        # One step of the k-th largest search at a threshold t: count = how many x >= t,
        # above = the smallest of them, below = the largest x < t. count == k: above is the
        # k-th largest. count == k - 1: the largest x below t has at least k values >= it and
        # fewer than k above it, so it is the k-th largest.
        if count == k:
            lo = above
            hi = above
        elif count == k - 1:
            lo = below
            hi = below
        elif count > k:
            lo = above
        else:
            hi = below
        return lo, hi

    @triton.jit
    def _kth_largest(row_ptr, bits_ptr, mask_cols, bit_start, vocab, k, lo, hi, probe,
                     BLOCK: tl.constexpr, BITMASK: tl.constexpr):
        # lo <= answer <= hi: each step moves one bound to an element inside (lo, hi], so the
        # loop ends on the k-th largest value itself. probe (int32, nonzero): lo is a close
        # guess (an element value with at least k values >= it); the first pass counts at lo
        # itself, which ends the search when exactly k values are >= it.
        while lo < hi:
            t = lo * 0.5 + hi * 0.5
            t = tl.where(t <= lo, hi, t)
            t = tl.where(probe != 0, lo, t)
            probe = probe * 0
            # Per-lane accumulators: one cross-thread reduction per pass, not per block.
            counts = tl.zeros([BLOCK], tl.int32)
            aboves = tl.full([BLOCK], float("inf"), tl.float32)  # smallest x >= t
            belows = tl.full([BLOCK], float("-inf"), tl.float32)  # largest x < t
            ahead = _load_block(row_ptr, bits_ptr, mask_cols, bit_start, 0, vocab, BLOCK, BITMASK)
            for start in range(0, vocab, BLOCK):
                x = ahead.to(tl.float32)
                ahead = _load_block(row_ptr, bits_ptr, mask_cols, bit_start, start + BLOCK, vocab,
                                    BLOCK, BITMASK)
                ge = x >= t
                counts += ge.to(tl.int32)
                aboves = tl.minimum(aboves, tl.where(ge, x, float("inf")))
                belows = tl.maximum(belows, tl.where(ge, float("-inf"), x))
            lo, hi = _kth_step(tl.sum(counts), tl.min(aboves), tl.max(belows), k, lo, hi)
        return lo

    @triton.jit
    def _kth_guess(firsts, seconds, k, lo, hi):
        # The k-th largest of each lane's two largest values (in registers, no pass over the
        # row): a lower bound on the row's k-th largest (k distinct elements are >= it), and
        # the value itself unless a lane holds three of the row's k largest.
        while lo < hi:
            t = lo * 0.5 + hi * 0.5
            t = tl.where(t <= lo, hi, t)
            ge_a = firsts >= t
            ge_b = seconds >= t
            count = tl.sum(ge_a.to(tl.int32)) + tl.sum(ge_b.to(tl.int32))
            above = tl.minimum(tl.min(tl.where(ge_a, firsts, float("inf"))),
                               tl.min(tl.where(ge_b, seconds, float("inf"))))
            below = tl.maximum(tl.max(tl.where(ge_a, float("-inf"), firsts)),
                               tl.max(tl.where(ge_b, float("-inf"), seconds)))
            lo, hi = _kth_step(count, above, below, k, lo, hi)
        return lo

    @triton.jit
    def _kth_search(row_ptr, bits_ptr, mask_cols, bit_start, vocab, k, firsts, seconds, raw_min,
                    raw_max, BLOCK: tl.constexpr, BITMASK: tl.constexpr):
        # The row's k-th largest, starting from the lanes' guess when they hold k values.
        held = tl.sum((firsts > float("-inf")).to(tl.int32))
        held += tl.sum((seconds > float("-inf")).to(tl.int32))
        lo = raw_min
        if held >= k:
            lo = _kth_guess(firsts, seconds, k, raw_min, raw_max)
        return _kth_largest(row_ptr, bits_ptr, mask_cols, bit_start, vocab, k, lo, raw_max,
                            (held >= k).to(tl.int32), BLOCK, BITMASK)

    @triton.jit
    def _probe_points(lo, hi):
        # Four thresholds evenly inside (lo, hi).
        step = (hi - lo) * 0.2
        return lo + step, lo + 2.0 * step, lo + 3.0 * step, lo + 4.0 * step

    @triton.jit
    def _mass_probes(row_ptr, bits_ptr, mask_cols, bit_start, vocab, raw_max, scale, keep_from, lo,
                     hi, BLOCK: tl.constexpr, BITMASK: tl.constexpr):
        # One pass: the mass of every kept x (>= keep_from) and of the kept x >= each of
        # _probe_points(lo, hi). Only sums: no tracking of the values next to a threshold.
        t1, t2, t3, t4 = _probe_points(lo, hi)
        totals = tl.zeros([BLOCK], tl.float32)
        m1 = tl.zeros([BLOCK], tl.float32)
        m2 = tl.zeros([BLOCK], tl.float32)
        m3 = tl.zeros([BLOCK], tl.float32)
        m4 = tl.zeros([BLOCK], tl.float32)
        ahead = _load_block(row_ptr, bits_ptr, mask_cols, bit_start, 0, vocab, BLOCK, BITMASK)
        for start in range(0, vocab, BLOCK):
            x = ahead.to(tl.float32)
            ahead = _load_block(row_ptr, bits_ptr, mask_cols, bit_start, start + BLOCK, vocab,
                                BLOCK, BITMASK)
            e = tl.where(x >= keep_from, tl.exp2((x - raw_max) * scale), 0.0)
            totals += e
            m1 += tl.where(x >= t1, e, 0.0)
            m2 += tl.where(x >= t2, e, 0.0)
            m3 += tl.where(x >= t3, e, 0.0)
            m4 += tl.where(x >= t4, e, 0.0)
        return tl.sum(totals), tl.sum(m1), tl.sum(m2), tl.sum(m3), tl.sum(m4)

    @triton.jit
    def _narrow(lo, hi, lo_mass, hi_mass, limit, m1, m2, m3, m4):
        # The bracket between the last probe whose mass exceeds limit and the first whose mass
        # does not (masses fall as the thresholds rise).
        t1, t2, t3, t4 = _probe_points(lo, hi)
        new_lo, new_lo_mass = lo, lo_mass
        new_hi, new_hi_mass = hi, hi_mass
        if m4 > limit:
            new_lo, new_lo_mass = t4, m4
        elif m3 > limit:
            new_lo, new_lo_mass, new_hi, new_hi_mass = t3, m3, t4, m4
        elif m2 > limit:
            new_lo, new_lo_mass, new_hi, new_hi_mass = t2, m2, t3, m3
        elif m1 > limit:
            new_lo, new_lo_mass, new_hi, new_hi_mass = t1, m1, t2, m2
        else:
            new_hi, new_hi_mass = t1, m1
        return new_lo, new_hi, new_lo_mass, new_hi_mass

    @triton.jit
    def _top_p_cut(row_ptr, bits_ptr, mask_cols, bit_start, vocab, raw_max, scale, keep_from, limit,
                   lo, hi, lo_mass, hi_mass, BLOCK: tl.constexpr, BITMASK: tl.constexpr):
        # The smallest x (>= keep_from) whose strictly-greater mass is <= limit, given
        # lo <= answer <= hi and lo_mass > limit (the mass of x >= lo). Either bound may be a
        # threshold rather than a value of the row: lo one whose mass exceeds limit, hi one
        # whose mass (hi_mass) does not, so the answer is a row value in [lo, hi); each pass
        # moves a bound onto a value of the row. If the mass of x >= t exceeds limit, the
        # largest x below t is dropped and so is all beneath it. The mass of the values next
        # to t (ties included) says whether one of them is the answer, which ends the search
        # a few passes early. Every other pass t is where the mass, taken as linear in x
        # between the bounds, meets the limit; the passes between halve (lo, hi], so a poor
        # interpolation costs at most every second pass.
        halve = tl.full((), 1, tl.int32)
        while lo < hi:
            span = lo_mass - hi_mass
            frac = (lo_mass - limit) / tl.where(span > 0.0, span, 1.0)
            frac = tl.where(span > 0.0, tl.minimum(tl.maximum(frac, 0.02), 0.98), 0.5)
            t = tl.where(halve != 0, lo * 0.5 + hi * 0.5, lo + (hi - lo) * frac)
            halve = 1 - halve
            t = tl.where(t <= lo, hi, t)
            masses = tl.zeros([BLOCK], tl.float32)
            aboves = tl.full([BLOCK], float("inf"), tl.float32)  # smallest x >= t
            above_masses = tl.zeros([BLOCK], tl.float32)  # mass of the tokens at that x
            belows = tl.full([BLOCK], float("-inf"), tl.float32)  # largest kept x < t
            below_masses = tl.zeros([BLOCK], tl.float32)
            ahead = _load_block(row_ptr, bits_ptr, mask_cols, bit_start, 0, vocab, BLOCK, BITMASK)
            for start in range(0, vocab, BLOCK):
                x = ahead.to(tl.float32)
                ahead = _load_block(row_ptr, bits_ptr, mask_cols, bit_start, start + BLOCK, vocab,
                                    BLOCK, BITMASK)
                ge = x >= t
                kept = x >= keep_from
                e = tl.where(kept, tl.exp2((x - raw_max) * scale), 0.0)
                masses += tl.where(ge, e, 0.0)
                a = tl.where(ge, x, float("inf"))
                above_masses = tl.where(a < aboves, e,
                                        tl.where(a == aboves, above_masses + e, above_masses))
                aboves = tl.minimum(aboves, a)
                b = tl.where(ge | ~kept, float("-inf"), x)
                below_masses = tl.where(b > belows, e,
                                        tl.where(b == belows, below_masses + e, below_masses))
                belows = tl.maximum(belows, b)
            mass = tl.sum(masses)
            above = tl.min(aboves)
            below = tl.max(belows)
            if mass > limit:
                lo = above
                lo_mass = mass  # no value lies in [t, above)
                # Mass strictly above `above` within the limit: it is kept, below is not.
                if mass - tl.sum(tl.where(aboves == above, above_masses, 0.0)) <= limit:
                    hi = above
            else:
                hi = below
                hi_mass = mass + tl.sum(tl.where(belows == below, below_masses, 0.0))
                # The value under `below` has more than the limit above it: below is the last.
                if hi_mass > limit:
                    lo = below
        return lo

    @triton.jit
    def _sample_row(
        row, logits_ptr, temps_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, seeds_ptr, offsets_ptr,
        tokens_ptr, logprobs_ptr, top_vals_ptr, top_ids_ptr, lse_ptr, allowed_ptr, scores_ptr,
        vocab, stride_row, vocab_start, num_logprobs, resolution, bitmask_ptr, bitmask_rows_ptr,
        stride_bitmask, TOP_N: tl.constexpr, LOGPROBS: tl.constexpr,
        WRITE_ALLOWED: tl.constexpr, BLOCK: tl.constexpr, MAX_PROBES: tl.constexpr,
        BITMASK: tl.constexpr,
    ):
        # The interpreter's range yields python ints, the compiler's int32 tensors.
        row64 = tl.cast(row, tl.int64)
        row_ptr = logits_ptr + row64 * stride_row
        # With BITMASK every load of the row (each pass) sets the tokens its bitmask row
        # clears to -inf, so the filters, the draw, the greedy argmax and the logprobs all see
        # the masked row; a row whose bitmask_rows entry is -1 loads no words.
        bits_ptr = bitmask_ptr
        mask_cols = tl.full((), 0, tl.int32)  # the columns whose bitmask words are loaded
        bit_start = vocab_start
        if BITMASK:
            mask_row = tl.load(bitmask_rows_ptr + row)
            mask_cols = tl.where(mask_row >= 0, vocab, 0)
            bits_ptr = bitmask_ptr + tl.maximum(mask_row, 0).to(tl.int64) * stride_bitmask
        temp = tl.load(temps_ptr + row)
        is_sampled = temp != 0.0
        temp = tl.where(is_sampled, temp, 1.0)

        # Pass 1: raw max (first argmax), smallest finite raw value, count of finite values.
        # A lane sees its indices in increasing order, so a strict > keeps its first argmax.
        maxes = tl.full([BLOCK], float("-inf"), tl.float32)
        seconds = tl.full([BLOCK], float("-inf"), tl.float32)  # each lane's second largest
        args = tl.zeros([BLOCK], tl.int32)
        mins = tl.full([BLOCK], float("inf"), tl.float32)
        finites = tl.zeros([BLOCK], tl.int32)
        ahead = _load_block(row_ptr, bits_ptr, mask_cols, bit_start, 0, vocab, BLOCK, BITMASK)
        for start in range(0, vocab, BLOCK):
            raw = ahead.to(tl.float32)
            ahead = _load_block(row_ptr, bits_ptr, mask_cols, bit_start, start + BLOCK, vocab,
                                BLOCK, BITMASK)
            idx = start + tl.arange(0, BLOCK)
            finite = raw > float("-inf")
            args = tl.where(raw > maxes, idx, args)
            seconds = tl.maximum(seconds, tl.minimum(maxes, raw))
            maxes = tl.maximum(maxes, raw)
            mins = tl.minimum(mins, tl.where(finite, raw, float("inf")))
            finites += finite.to(tl.int32)
        raw_max = tl.max(maxes)
        argmax = tl.min(tl.where(maxes == raw_max, args, vocab))
        raw_min = tl.min(mins)
        num_finite = tl.sum(finites)
        # x = raw * inv_temp, both roundings as torch's (1 / temperature, then the product).
        # A rounded product with a positive number is monotone, so a cut on x is the product
        # of a cut on the raw values: the searches run on raw values.
        inv_temp = tl.math.div_rn(tl.full((), 1.0, tl.float32), temp)
        x_max = scaled(raw_max, inv_temp)
        scale = 1.4426950408889634 / temp  # exp(x - x_max) as one exp2 of raw values

        k_cut = tl.full((), float("-inf"), tl.float32)
        k_raw = tl.full((), float("-inf"), tl.float32)
        p_cut = tl.full((), float("-inf"), tl.float32)
        log_min_p = tl.full((), float("-inf"), tl.float32)
        if is_sampled:
            top_k = tl.load(top_ks_ptr + row)
            if (top_k > 0) & (top_k < num_finite):
                k_raw = _kth_search(row_ptr, bits_ptr, mask_cols, bit_start, vocab, top_k, maxes,
                                    seconds, raw_min, raw_max, BLOCK, BITMASK)
                k_cut = k_raw * inv_temp
            top_p = tl.load(top_ps_ptr + row)
            if top_p < 1.0:
                # Passes of four mass probes each shrink the bracket five-fold (the first also
                # sums the total), until it holds at most about two values of the logits'
                # dtype (resolution: its relative spacing); the exact search ends it.
                lo = tl.maximum(k_raw, raw_min)
                hi = raw_max
                total, m1, m2, m3, m4 = _mass_probes(row_ptr, bits_ptr, mask_cols, bit_start, vocab,
                                                     raw_max, scale, k_raw, lo, hi, BLOCK,
                                                     BITMASK)
                limit = top_p * total
                hi_mass = tl.full((), 1.0, tl.float32)  # the largest value's own, at least
                lo, hi, lo_mass, hi_mass = _narrow(lo, hi, total, hi_mass, limit, m1, m2, m3,
                                                   m4)
                # Within a small top-k set the exact search is as quick on its own.
                max_probes = tl.where((top_k > 0) & (top_k <= 64), 1, MAX_PROBES)
                probes = 1
                while (probes < max_probes) & (
                        hi - lo > resolution * tl.maximum(tl.abs(lo), tl.abs(hi))):
                    _, m1, m2, m3, m4 = _mass_probes(row_ptr, bits_ptr, mask_cols, bit_start, vocab,
                                                     raw_max, scale, k_raw, lo, hi, BLOCK,
                                                     BITMASK)
                    lo, hi, lo_mass, hi_mass = _narrow(lo, hi, lo_mass, hi_mass, limit, m1, m2,
                                                       m3, m4)
                    probes += 1
                p_raw = _top_p_cut(row_ptr, bits_ptr, mask_cols, bit_start, vocab, raw_max, scale,
                                   k_raw, limit, lo, hi, lo_mass, hi_mass, BLOCK, BITMASK)
                p_cut = p_raw * inv_temp
            min_p = tl.load(min_ps_ptr + row)
            if min_p > 0.0:
                log_min_p = tl.log(min_p)
        n_cut = tl.full((), float("-inf"), tl.float32)
        if TOP_N:
            if num_logprobs < num_finite:
                n_cut = _kth_search(row_ptr, bits_ptr, mask_cols, bit_start, vocab, num_logprobs,
                                    maxes, seconds, raw_min, raw_max, BLOCK, BITMASK)

        # Last pass: Gumbel-max over the allowed tokens, the raw softmax sum, top-n raw logits.
        seed = tl.load(seeds_ptr + row)
        offset = tl.load(offsets_ptr + row)
        key_a, key_b = row_keys(seed, offset)
        filtered = (k_cut > float("-inf")) | (p_cut > float("-inf"))
        filtered |= log_min_p > float("-inf")
        bests = tl.full([BLOCK], float("-inf"), tl.float32)
        tokens = tl.zeros([BLOCK], tl.int32)
        sum_exps = tl.zeros([BLOCK], tl.float32)
        top_above = tl.full((), 0, tl.int32)
        top_tied = tl.full((), 0, tl.int32)
        ahead = _load_block(row_ptr, bits_ptr, mask_cols, bit_start, 0, vocab, BLOCK, BITMASK)
        for start in range(0, vocab, BLOCK):
            raw = ahead.to(tl.float32)
            ahead = _load_block(row_ptr, bits_ptr, mask_cols, bit_start, start + BLOCK, vocab,
                                BLOCK, BITMASK)
            idx = start + tl.arange(0, BLOCK)
            if LOGPROBS:
                sum_exps += tl.exp(raw - raw_max)
            x = scaled(raw, inv_temp)
            allowed = (x > float("-inf")) & (x >= k_cut) & (x >= p_cut)
            allowed &= (x - x_max) >= log_min_p
            if WRITE_ALLOWED:
                tl.store(allowed_ptr + row64 * vocab + idx, allowed.to(tl.int8),
                         mask=idx < vocab)
            if is_sampled:
                # A filter leaves most blocks of a row without an allowed token: no noise there.
                noisy = True
                if filtered:
                    noisy = tl.max(allowed.to(tl.int32)) > 0
                if noisy:
                    u = uniform(idx + vocab_start, key_a, key_b)  # keyed by the token's id
                    score = tl.where(allowed, noisy_score(x, u), float("-inf"))
                    tokens = tl.where(score > bests, idx, tokens)
                    bests = tl.maximum(bests, score)
            if TOP_N:
                # Values above the n-th largest (fewer than n) fill slots 0.., the first n
                # tokens equal to it slots n..: ties at the cut never crowd out a larger value.
                above = raw > n_cut
                tied = (raw == n_cut) & (raw > float("-inf"))
                num_above = tl.sum(above.to(tl.int32))
                num_tied = tl.sum(tied.to(tl.int32))
                if num_above + num_tied > 0:  # a few blocks of the row: no scan in the rest
                    above_pos = top_above + tl.cumsum(above.to(tl.int32), 0) - 1
                    tied_pos = top_tied + tl.cumsum(tied.to(tl.int32), 0) - 1
                    keep = (above & (above_pos < num_logprobs)) | (tied & (tied_pos <
                                                                          num_logprobs))
                    out = row64 * (2 * num_logprobs) + tl.where(above, above_pos,
                                                                num_logprobs + tied_pos)
                    tl.store(top_vals_ptr + out, raw, mask=keep)
                    tl.store(top_ids_ptr + out, idx.to(tl.int64), mask=keep)
                    top_above += num_above
                    top_tied += num_tied
        token = argmax
        score = raw_max
        if is_sampled:
            best = tl.max(bests)
            token = tl.min(tl.where(bests == best, tokens, vocab))
            score = best
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(scores_ptr + row, score)
        if LOGPROBS:
            lse = raw_max + tl.log(tl.sum(sum_exps))
            tl.store(lse_ptr + row, lse)
            raw_token = tl.load(row_ptr + token).to(tl.float32)
            tl.store(logprobs_ptr + row, raw_token - lse)

    # The batch size, the per-row settings (slices of per-slot tensors) and the number of top
    # logprobs change from step to step: not specialized, so none of them compiles a new
    # variant (only TOP_N / LOGPROBS switch the top-n and softmax work on or off).
    @triton.jit(do_not_specialize=["temps_ptr", "top_ks_ptr", "top_ps_ptr", "min_ps_ptr",
                                   "seeds_ptr", "offsets_ptr", "batch", "vocab_start",
                                   "num_logprobs", "bitmask_ptr", "bitmask_rows_ptr",
                                   "stride_bitmask"])
    def _sample_kernel(
        logits_ptr, temps_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, seeds_ptr, offsets_ptr,
        tokens_ptr, logprobs_ptr, top_vals_ptr, top_ids_ptr, lse_ptr, allowed_ptr, scores_ptr,
        batch, vocab, stride_row, vocab_start, num_logprobs, resolution, bitmask_ptr,
        bitmask_rows_ptr, stride_bitmask, TOP_N: tl.constexpr, LOGPROBS: tl.constexpr,
        WRITE_ALLOWED: tl.constexpr, BLOCK: tl.constexpr, MAX_PROBES: tl.constexpr,
        BITMASK: tl.constexpr,
    ):
        # A program passes over its row many times. With one program per SM walking the rows,
        # the rows in flight (132 x 300 KB of bf16 at a 152k vocabulary) stay in L2, so only
        # the first pass reads HBM; a program per row would keep the whole batch in flight.
        for row in range(tl.program_id(0), batch, tl.num_programs(0)):
            _sample_row(
                row, logits_ptr, temps_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, seeds_ptr,
                offsets_ptr, tokens_ptr, logprobs_ptr, top_vals_ptr, top_ids_ptr, lse_ptr,
                allowed_ptr, scores_ptr, vocab, stride_row, vocab_start, num_logprobs,
                resolution, bitmask_ptr, bitmask_rows_ptr, stride_bitmask, TOP_N, LOGPROBS,
                WRITE_ALLOWED, BLOCK, MAX_PROBES, BITMASK,
            )

# Passes of mass probes at most before the top-p search's exact passes, and the relative spacing
# of each logits dtype (a bracket narrower than it around its values holds about two of them).
MAX_PROBES = 6
_RESOLUTION = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
# Frontier points kept per chunk (F) and per row (R) by the chunked draw of rows without top-k
# (sampler_chunks.draw_frontier): a chunk of 2,048 random values has ~2-7, a flat row of 152k
# ~12; a row past them takes the full kernel's walk.
FRONTIER = (16, 32)


def _launch(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    num_logprobs: int,
    allowed: torch.Tensor | None,
    block: int | None,
    num_warps: int | None,
    vocab_start: int = 0,
    programs_per_sm: int = 1,
    logprobs: bool = True,
    bitmask: torch.Tensor | None = None,
    bitmask_rows: torch.Tensor | None = None,
) -> FusedSample:
    assert triton is not None, "sample_fused needs triton; use sample_ref"
    assert logits.dim() == 2 and logits.stride(1) == 1, (logits.shape, logits.stride())
    assert logits.dtype in (torch.float32, torch.float16, torch.bfloat16), logits.dtype
    batch, vocab = logits.shape
    dev = logits.device
    for t, dtype in ((temperatures, torch.float32), (top_ks, torch.int32),
                     (top_ps, torch.float32), (min_ps, torch.float32),
                     (seeds, torch.int64), (offsets, torch.int64)):
        assert t.shape == (batch,) and t.dtype == dtype and t.device == dev, (t.shape, t.dtype)
        assert t.is_contiguous()
    assert 0 <= num_logprobs <= vocab, num_logprobs
    tokens = torch.empty(batch, dtype=torch.int64, device=dev)
    token_logprobs = torch.empty(batch, dtype=torch.float32, device=dev)
    lse = torch.empty(batch, dtype=torch.float32, device=dev)
    scores = torch.empty(batch, dtype=torch.float32, device=dev)
    # Twice the slots: the values above the cut, then those tied with it (see the kernel).
    # Without top logprobs the kernel never touches them: no buffers, no fill kernels.
    top_vals, top_ids = scores, tokens
    if num_logprobs:
        top_vals = torch.full((batch, 2 * num_logprobs), float("-inf"), dtype=torch.float32,
                              device=dev)  # fmt: skip
        top_ids = torch.zeros(batch, 2 * num_logprobs, dtype=torch.int64, device=dev)
    if block is None:
        block = min(4096, triton.next_power_of_2(vocab))
    if num_warps is None:
        num_warps = 16 if block >= 4096 else 4
    if bitmask is not None:
        bitmask_rows = check_bitmask(bitmask, bitmask_rows, batch, vocab, vocab_start, dev)
    if batch > 0:
        grid = (min(batch, programs_per_sm * num_sms(dev)),)
        _sample_kernel[grid](
            logits, temperatures, top_ks, top_ps, min_ps, seeds, offsets,
            tokens, token_logprobs, top_vals, top_ids, lse,
            allowed if allowed is not None else tokens,
            scores, batch, vocab, logits.stride(0), vocab_start, num_logprobs,
            _RESOLUTION[logits.dtype],
            bitmask if bitmask is not None else seeds,
            bitmask_rows if bitmask is not None else seeds,
            bitmask.stride(0) if bitmask is not None else 0,
            TOP_N=num_logprobs > 0, LOGPROBS=logprobs or num_logprobs > 0,
            WRITE_ALLOWED=allowed is not None, BLOCK=block, MAX_PROBES=MAX_PROBES,
            BITMASK=bitmask is not None, num_warps=num_warps,
        )
    if num_logprobs == 0:
        return FusedSample(tokens, token_logprobs if logprobs else None, None, None, scores)
    # The kernel gathers the top-n in vocabulary order; ordering 2n values is a tiny sort (a
    # stable one: of tied values, those of the lowest token ids come first).
    top_vals, order = top_vals.sort(dim=1, descending=True, stable=True)
    top_vals, top_ids = top_vals[:, :num_logprobs], top_ids.gather(1, order[:, :num_logprobs])
    return FusedSample(tokens, token_logprobs, top_vals - lse[:, None], top_ids, scores)


def allowed_mask_fused(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    *,
    block: int | None = None,
    bitmask: torch.Tensor | None = None,
    bitmask_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel's allowed set [batch, vocab] bool, for comparing with allowed_mask_ref (of
    apply_bitmask_ref's logits when a bitmask is given)."""
    batch, vocab = logits.shape
    allowed = torch.zeros(batch, vocab, dtype=torch.int8, device=logits.device)
    zeros = torch.zeros(batch, dtype=torch.int64, device=logits.device)
    _launch(logits, temperatures, top_ks, top_ps, min_ps, zeros, zeros, 0, allowed, block, None,
            bitmask=bitmask, bitmask_rows=bitmask_rows)
    return allowed.bool()
