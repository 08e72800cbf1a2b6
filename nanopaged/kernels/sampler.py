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
min_tokens is the caller's: it sets a banned stop token's logit to -inf (a -inf token is never
allowed). Penalties are the caller's too: engine/sampling.penalize applies them first
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

Rows without top-k or top-p need no search: sample_fused(plain=True) draws them in chunks of
the row side by side (_draw_chunked), with the same bits per token as the full kernel. Rows
without top-k need none either (sample_fused(top_k=False), _draw_frontier): the draw under a
cut x >= t is, for every t, one of a few candidate tokens (each the best score among the
tokens above the one before it), so the masses above those candidates, summed in one chunked
pass, say which one top-p keeps, with the full kernel's tokens.
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


# Columns per chunk of argmax_ref's two-level search.
ARGMAX_CHUNK = 128


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """logits [batch, vocab] -> logits.argmax(dim=-1): each row's first maximum (a NaN counts as
    the maximum, as in argmax).

    On CPU, torch's argmax walks a row an element at a time (1.3 ms for 16 rows of 49,152 on 2
    threads); the first ARGMAX_CHUNK-column chunk holding the row's maximum (a vectorized amax
    per chunk) and the first maximum inside it give the same index in a fifth of that.
    """
    batch, vocab = logits.shape
    if logits.device.type != "cpu" or vocab % ARGMAX_CHUNK or not logits.is_contiguous():
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
) -> FusedSample:
    """Torch reference of sample_fused (same arguments, same tokens and scores; plain, min_p
    and top_k, promises about the rows' filters, and frontier change nothing here)."""
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
    def _load_block(row_ptr, start, vocab, BLOCK: tl.constexpr):
        # The logits' own dtype (converting would wait for the load); -inf past the vocabulary.
        idx = start + tl.arange(0, BLOCK)
        return tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf"))

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
    def _kth_largest(row_ptr, vocab, k, lo, hi, probe, BLOCK: tl.constexpr):
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
            ahead = _load_block(row_ptr, 0, vocab, BLOCK)
            for start in range(0, vocab, BLOCK):
                x = ahead.to(tl.float32)
                ahead = _load_block(row_ptr, start + BLOCK, vocab, BLOCK)
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
    def _kth_search(row_ptr, vocab, k, firsts, seconds, raw_min, raw_max,
                    BLOCK: tl.constexpr):
        # The row's k-th largest, starting from the lanes' guess when they hold k values.
        held = tl.sum((firsts > float("-inf")).to(tl.int32))
        held += tl.sum((seconds > float("-inf")).to(tl.int32))
        lo = raw_min
        if held >= k:
            lo = _kth_guess(firsts, seconds, k, raw_min, raw_max)
        return _kth_largest(row_ptr, vocab, k, lo, raw_max, (held >= k).to(tl.int32), BLOCK)

    @triton.jit
    def _probe_points(lo, hi):
        # Four thresholds evenly inside (lo, hi).
        step = (hi - lo) * 0.2
        return lo + step, lo + 2.0 * step, lo + 3.0 * step, lo + 4.0 * step

    @triton.jit
    def _mass_probes(row_ptr, vocab, raw_max, scale, keep_from, lo, hi, BLOCK: tl.constexpr):
        # One pass: the mass of every kept x (>= keep_from) and of the kept x >= each of
        # _probe_points(lo, hi). Only sums: no tracking of the values next to a threshold.
        t1, t2, t3, t4 = _probe_points(lo, hi)
        totals = tl.zeros([BLOCK], tl.float32)
        m1 = tl.zeros([BLOCK], tl.float32)
        m2 = tl.zeros([BLOCK], tl.float32)
        m3 = tl.zeros([BLOCK], tl.float32)
        m4 = tl.zeros([BLOCK], tl.float32)
        ahead = _load_block(row_ptr, 0, vocab, BLOCK)
        for start in range(0, vocab, BLOCK):
            x = ahead.to(tl.float32)
            ahead = _load_block(row_ptr, start + BLOCK, vocab, BLOCK)
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
    def _top_p_cut(row_ptr, vocab, raw_max, scale, keep_from, limit, lo, hi, lo_mass, hi_mass,
                   BLOCK: tl.constexpr):
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
            ahead = _load_block(row_ptr, 0, vocab, BLOCK)
            for start in range(0, vocab, BLOCK):
                x = ahead.to(tl.float32)
                ahead = _load_block(row_ptr, start + BLOCK, vocab, BLOCK)
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
    def _first_max(x, idx, BIG: tl.constexpr):
        # The first index of x's maximum, a NaN counting as the maximum (argmax's rule), and
        # that maximum (NaN where one was found).
        nan = x != x
        first_nan = tl.min(tl.where(nan, idx, BIG))
        best = tl.max(tl.where(nan, float("-inf"), x))
        first = tl.min(tl.where(x == best, idx, BIG))
        has_nan = first_nan < BIG
        return tl.where(has_nan, first_nan, first), tl.where(has_nan, float("nan"), best)

    @triton.jit
    def _load_chunk(logits_ptr, vocab, stride_row, BLOCK: tl.constexpr):
        # Program (row, chunk) of a grid over rows and chunks of BLOCK columns: its row (int64),
        # column indices and fp32 values, and the slot of its per-chunk outputs. Padding past
        # the vocabulary is -inf with an index past every real one: never first.
        row64 = tl.program_id(0).to(tl.int64)
        idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        raw = tl.load(logits_ptr + row64 * stride_row + idx, mask=idx < vocab,
                      other=float("-inf")).to(tl.float32)
        return row64, idx, raw, row64 * tl.num_programs(1) + tl.program_id(1)

    @triton.jit
    def _argmax_chunks_kernel(logits_ptr, vals_ptr, idx_ptr, vocab, stride_row,
                              BLOCK: tl.constexpr):
        # Program (row, chunk): the chunk's first maximum. Chunks of a row run side by side,
        # so one row (a batch-1 decode step) is spread over the SMs, not read by one.
        _, idx, x, out = _load_chunk(logits_ptr, vocab, stride_row, BLOCK)
        first, best = _first_max(x, idx, 2147483647)
        tl.store(vals_ptr + out, best)
        tl.store(idx_ptr + out, first)

    @triton.jit
    def _chunk_stats_kernel(logits_ptr, maxes_ptr, sums_ptr, vocab, stride_row,
                            BLOCK: tl.constexpr, SUMS: tl.constexpr):
        # Program (row, chunk): the chunk's largest raw logit; with SUMS the sum of exp(raw -
        # that maximum) (0 for a chunk all -inf).
        _, idx, raw, out = _load_chunk(logits_ptr, vocab, stride_row, BLOCK)
        m = tl.max(raw)
        tl.store(maxes_ptr + out, m)
        if SUMS:
            finite = raw > float("-inf")
            s = tl.sum(tl.where(finite, tl.exp(raw - tl.where(finite, m, 0.0)), 0.0))
            tl.store(sums_ptr + out, s)

    @triton.jit
    def _chunk_top_n(raw, idx, maxima, top_vals_ptr, top_ids_ptr, num_logprobs):
        # The chunk's candidates for its row's num_logprobs largest raw values, largest first,
        # the lowest index first among equal ones (a slot past the finite values: -inf, token
        # 0). A chunk whose maximum has num_logprobs chunk maxima above it holds none of them
        # (that many values are larger than all of its own) and skips the search: most do.
        vals = raw
        best = tl.max(vals)
        skip = tl.sum((maxima > best).to(tl.int32)) >= num_logprobs
        for j in range(num_logprobs):
            first = tl.full((), 0, tl.int32)
            if not skip:
                first = tl.min(tl.where(vals == best, idx, 2147483647))
                first = tl.where(best > float("-inf"), first, 0)
            tl.store(top_vals_ptr + j, tl.where(skip, float("-inf"), best))
            tl.store(top_ids_ptr + j, first)
            if not skip:
                vals = tl.where(idx == first, float("-inf"), vals)
                best = tl.max(vals)

    @triton.jit(do_not_specialize=["temps_ptr", "min_ps_ptr", "seeds_ptr", "offsets_ptr",
                                   "vocab_start"])
    def _draw_chunks_kernel(logits_ptr, temps_ptr, min_ps_ptr, seeds_ptr, offsets_ptr,
                            maxes_ptr, vals_ptr, idx_ptr, top_vals_ptr, top_ids_ptr, vocab,
                            stride_row, vocab_start, num_logprobs, BLOCK: tl.constexpr,
                            MIN_P: tl.constexpr, BLOCK_C: tl.constexpr, TOP_N: tl.constexpr):
        # Program (row, chunk) of a row with no top-k or top-p: the chunk's best score and its
        # first index, the score computed as _sample_row's last pass does (x + noise over the
        # allowed x, x = raw * (1 / temperature)), or a greedy row's raw maximum as
        # _argmax_chunks_kernel finds it. With MIN_P the row's maximum for the min-p cut comes
        # from the chunks' maxima (_chunk_stats_kernel), and with TOP_N the chunk's candidates
        # for the top logprobs too (_chunk_top_n). One pass, chunks side by side: no row waits
        # on one program's walk through its whole vocabulary.
        row64, idx, raw, out = _load_chunk(logits_ptr, vocab, stride_row, BLOCK)
        row = tl.program_id(0)
        if TOP_N:
            c = tl.arange(0, BLOCK_C)
            maxima = tl.load(maxes_ptr + row64 * tl.num_programs(1) + c,
                             mask=c < tl.num_programs(1), other=float("-inf"))
            _chunk_top_n(raw, idx, maxima, top_vals_ptr + out * num_logprobs,
                         top_ids_ptr + out * num_logprobs, num_logprobs)
        temp = tl.load(temps_ptr + row)
        if temp == 0.0:
            first, best = _first_max(raw, idx, 2147483647)
        else:
            inv_temp = tl.math.div_rn(tl.full((), 1.0, tl.float32), temp)
            x = scaled(raw, inv_temp)
            allowed = x > float("-inf")
            if MIN_P:
                min_p = tl.load(min_ps_ptr + row)
                if min_p > 0.0:
                    c = tl.arange(0, BLOCK_C)
                    maxima = tl.load(maxes_ptr + row64 * tl.num_programs(1) + c,
                                     mask=c < tl.num_programs(1), other=float("-inf"))
                    x_max = scaled(tl.max(maxima), inv_temp)
                    allowed &= (x - x_max) >= tl.log(min_p)
            key_a, key_b = row_keys(tl.load(seeds_ptr + row), tl.load(offsets_ptr + row))
            u = uniform(idx + vocab_start, key_a, key_b)
            score = tl.where(allowed, noisy_score(x, u), float("-inf"))
            best = tl.max(score)
            first = tl.min(tl.where(score == best, idx, 2147483647))
        tl.store(vals_ptr + out, best)
        tl.store(idx_ptr + out, first)

    @triton.jit
    def _argmax_merge_kernel(vals_ptr, idx_ptr, tokens_ptr, scores_ptr, maxes_ptr, sums_ptr,
                             logits_ptr, logprobs_ptr, lse_ptr, top_vals_ptr, top_ids_ptr,
                             top_lp_ptr, top_tok_ptr, num_chunks, stride_row, num_logprobs,
                             BLOCK_C: tl.constexpr, SCORES: tl.constexpr,
                             LOGPROBS: tl.constexpr, BLOCK_T: tl.constexpr):
        # Program row: the first of its chunks' maxima (chunks in column order, so the lowest
        # index of a tie or of a NaN is the first chunk's), and with SCORES that maximum. With
        # LOGPROBS the row's log-sum-exp from the chunks' maxima and sums, and the token's
        # raw logprob; with BLOCK_T > 0 the row's top logprobs from its chunks' candidates,
        # largest first, the lowest token id first among equal values.
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK_C)
        mask = c < num_chunks
        vals = tl.load(vals_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
        idx = tl.load(idx_ptr + row * num_chunks + c, mask=mask, other=2147483647)
        token, best = _first_max(vals, idx, 2147483647)
        tl.store(tokens_ptr + row, token.to(tl.int64))
        if SCORES:
            tl.store(scores_ptr + row, best)
        if LOGPROBS:
            maxima = tl.load(maxes_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
            sums = tl.load(sums_ptr + row * num_chunks + c, mask=mask, other=0.0)
            m = tl.max(maxima)
            lse = m + tl.log(tl.sum(sums * tl.exp(maxima - m)))
            tl.store(lse_ptr + row, lse)
            raw_token = tl.load(logits_ptr + row * stride_row + token).to(tl.float32)
            tl.store(logprobs_ptr + row, raw_token - lse)
            if BLOCK_T > 0:
                t = tl.arange(0, BLOCK_T)
                alive = t < num_chunks * num_logprobs
                base = row * num_chunks * num_logprobs
                cand = tl.load(top_vals_ptr + base + t, mask=alive, other=float("-inf"))
                ids = tl.load(top_ids_ptr + base + t, mask=alive, other=2147483647)
                for j in range(num_logprobs):
                    best = tl.max(tl.where(alive, cand, float("-inf")))
                    tied = alive & (cand == best)
                    first = tl.min(tl.where(tied, ids, 2147483647))
                    pos = tl.min(tl.where(tied & (ids == first), t, BLOCK_T))
                    alive &= t != pos
                    tl.store(top_lp_ptr + row * num_logprobs + j, best - lse)
                    tl.store(top_tok_ptr + row * num_logprobs + j,
                             tl.where(best > float("-inf"), first, 0).to(tl.int64))

    @triton.jit
    def _sample_row(
        row, logits_ptr, temps_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, seeds_ptr, offsets_ptr,
        tokens_ptr, logprobs_ptr, top_vals_ptr, top_ids_ptr, lse_ptr, allowed_ptr, scores_ptr,
        vocab, stride_row, vocab_start, num_logprobs, resolution,
        TOP_N: tl.constexpr, LOGPROBS: tl.constexpr, WRITE_ALLOWED: tl.constexpr,
        BLOCK: tl.constexpr, MAX_PROBES: tl.constexpr,
    ):
        # The interpreter's range yields python ints, the compiler's int32 tensors.
        row64 = tl.cast(row, tl.int64)
        row_ptr = logits_ptr + row64 * stride_row
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
        ahead = _load_block(row_ptr, 0, vocab, BLOCK)
        for start in range(0, vocab, BLOCK):
            raw = ahead.to(tl.float32)
            ahead = _load_block(row_ptr, start + BLOCK, vocab, BLOCK)
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
                k_raw = _kth_search(row_ptr, vocab, top_k, maxes, seconds, raw_min, raw_max,
                                    BLOCK)
                k_cut = k_raw * inv_temp
            top_p = tl.load(top_ps_ptr + row)
            if top_p < 1.0:
                # Passes of four mass probes each shrink the bracket five-fold (the first also
                # sums the total), until it holds at most about two values of the logits'
                # dtype (resolution: its relative spacing); the exact search ends it.
                lo = tl.maximum(k_raw, raw_min)
                hi = raw_max
                total, m1, m2, m3, m4 = _mass_probes(row_ptr, vocab, raw_max, scale, k_raw,
                                                     lo, hi, BLOCK)
                limit = top_p * total
                hi_mass = tl.full((), 1.0, tl.float32)  # the largest value's own, at least
                lo, hi, lo_mass, hi_mass = _narrow(lo, hi, total, hi_mass, limit, m1, m2, m3,
                                                   m4)
                # Within a small top-k set the exact search is as quick on its own.
                max_probes = tl.where((top_k > 0) & (top_k <= 64), 1, MAX_PROBES)
                probes = 1
                while (probes < max_probes) & (
                        hi - lo > resolution * tl.maximum(tl.abs(lo), tl.abs(hi))):
                    _, m1, m2, m3, m4 = _mass_probes(row_ptr, vocab, raw_max, scale, k_raw, lo,
                                                     hi, BLOCK)
                    lo, hi, lo_mass, hi_mass = _narrow(lo, hi, lo_mass, hi_mass, limit, m1, m2,
                                                       m3, m4)
                    probes += 1
                p_raw = _top_p_cut(row_ptr, vocab, raw_max, scale, k_raw, limit, lo, hi,
                                   lo_mass, hi_mass, BLOCK)
                p_cut = p_raw * inv_temp
            min_p = tl.load(min_ps_ptr + row)
            if min_p > 0.0:
                log_min_p = tl.log(min_p)
        n_cut = tl.full((), float("-inf"), tl.float32)
        if TOP_N:
            if num_logprobs < num_finite:
                n_cut = _kth_search(row_ptr, vocab, num_logprobs, maxes, seconds, raw_min,
                                    raw_max, BLOCK)

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
        ahead = _load_block(row_ptr, 0, vocab, BLOCK)
        for start in range(0, vocab, BLOCK):
            raw = ahead.to(tl.float32)
            ahead = _load_block(row_ptr, start + BLOCK, vocab, BLOCK)
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
                                   "num_logprobs"])
    def _sample_kernel(
        logits_ptr, temps_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, seeds_ptr, offsets_ptr,
        tokens_ptr, logprobs_ptr, top_vals_ptr, top_ids_ptr, lse_ptr, allowed_ptr, scores_ptr,
        batch, vocab, stride_row, vocab_start, num_logprobs, resolution,
        TOP_N: tl.constexpr, LOGPROBS: tl.constexpr, WRITE_ALLOWED: tl.constexpr,
        BLOCK: tl.constexpr, MAX_PROBES: tl.constexpr,
    ):
        # A program passes over its row many times. With one program per SM walking the rows,
        # the rows in flight (132 x 300 KB of bf16 at a 152k vocabulary) stay in L2, so only
        # the first pass reads HBM; a program per row would keep the whole batch in flight.
        for row in range(tl.program_id(0), batch, tl.num_programs(0)):
            _sample_row(
                row, logits_ptr, temps_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, seeds_ptr,
                offsets_ptr, tokens_ptr, logprobs_ptr, top_vals_ptr, top_ids_ptr, lse_ptr,
                allowed_ptr, scores_ptr, vocab, stride_row, vocab_start, num_logprobs,
                resolution, TOP_N, LOGPROBS, WRITE_ALLOWED, BLOCK, MAX_PROBES,
            )

    # ---- rows with top-p (and min-p) but no top-k, in chunks side by side ----------------
    #
    # Over the tokens allowed by a cut t on the raw values (x >= t: top-p's and min-p's cuts
    # are both of this form), the draw is the argmax of score = x + noise (the first index
    # on ties). A "frontier" of a set of tokens lists that argmax for every t: its first
    # point is the best score of the set, each next one the best score among the tokens with
    # a larger raw value than the point before. For a cut t the draw is the first point whose
    # raw value is >= t (every token before it lies below t; it beats every token at or above
    # t). A frontier is short (a few points for 2,048 random values, a dozen for a flat row of
    # 152k), so the cut needs no search: the tokens' masses above each point of the row's
    # frontier tell which points top-p keeps.

    @triton.jit
    def _frontier_points(raw, score, valid, raw_at, idx_at, out_raw, out_score, out_idx,
                         CAP: tl.constexpr, stop_at, IDX_AT_PTR: tl.constexpr):
        # Store the frontier of the valid tokens (at most CAP points, while the last point's
        # raw value is below stop_at) at out_*[0..]; return the number stored and whether a
        # token with a finite score was left above the last point (the frontier goes on).
        # Position i of raw/score holds raw_at[i] (a pointer) and token idx_at[i] (a pointer
        # with IDX_AT_PTR, else idx_at + i); one argmax reduction a point (the first position
        # of the best score: the lowest token id, positions being in token order).
        floor = tl.full((), float("-inf"), tl.float32)
        n = tl.full((), 0, tl.int32)
        s = tl.where(valid, score, float("-inf"))
        best, pos = tl.max(s, 0, return_indices=True, return_indices_tie_break_left=True)
        while (n < CAP) & (best > float("-inf")) & (floor < stop_at):
            floor = tl.load(raw_at + pos).to(tl.float32)
            if IDX_AT_PTR:
                first = tl.load(idx_at + pos)
            else:
                first = idx_at + pos
            tl.store(out_raw + n, floor)
            tl.store(out_score + n, best)
            tl.store(out_idx + n, first)
            n += 1
            s = tl.where(valid & (raw > floor), score, float("-inf"))
            best, pos = tl.max(s, 0, return_indices=True, return_indices_tie_break_left=True)
        return n, best > float("-inf")

    @triton.jit(do_not_specialize=["temps_ptr", "seeds_ptr", "offsets_ptr", "vocab_start"])
    def _frontier_chunks_kernel(logits_ptr, temps_ptr, seeds_ptr, offsets_ptr, maxes_ptr,
                                sums_ptr, f_raw_ptr, f_score_ptr, f_idx_ptr, f_count_ptr, vocab,
                                stride_row, vocab_start, BLOCK: tl.constexpr, F: tl.constexpr,
                                SUMS: tl.constexpr):
        # Program (row, chunk): the chunk's raw maximum (with SUMS its sum of exp(raw - that
        # maximum)) and the frontier of its tokens, scores as _sample_row's last pass computes
        # them. Its count is F + 1 when F points did not hold it. A greedy row's one point is
        # the chunk's first raw maximum (a NaN counting as the maximum).
        row64, idx, raw, out = _load_chunk(logits_ptr, vocab, stride_row, BLOCK)
        row = tl.program_id(0)
        m = tl.max(raw)
        tl.store(maxes_ptr + out, m)
        if SUMS:
            finite = raw > float("-inf")
            tl.store(sums_ptr + out,
                     tl.sum(tl.where(finite, tl.exp(raw - tl.where(finite, m, 0.0)), 0.0)))
        temp = tl.load(temps_ptr + row)
        if temp == 0.0:
            first, best = _first_max(raw, idx, 2147483647)
            tl.store(f_raw_ptr + out * F, best)
            tl.store(f_score_ptr + out * F, best)
            tl.store(f_idx_ptr + out * F, first)
            tl.store(f_count_ptr + out, 1)
        else:
            inv_temp = tl.math.div_rn(tl.full((), 1.0, tl.float32), temp)
            x = scaled(raw, inv_temp)
            key_a, key_b = row_keys(tl.load(seeds_ptr + row), tl.load(offsets_ptr + row))
            u = uniform(idx + vocab_start, key_a, key_b)
            score = tl.where(x > float("-inf"), noisy_score(x, u), float("-inf"))
            start = tl.program_id(1) * BLOCK
            n, more = _frontier_points(raw, score, raw > float("-inf"),
                                       logits_ptr + row64 * stride_row + start, start,
                                       f_raw_ptr + out * F, f_score_ptr + out * F,
                                       f_idx_ptr + out * F, F, float("inf"), False)
            tl.store(f_count_ptr + out, n + more.to(tl.int32))

    @triton.jit
    def _frontier_merge_kernel(f_raw_ptr, f_score_ptr, f_idx_ptr, f_count_ptr, maxes_ptr,
                               temps_ptr, r_raw_ptr, r_score_ptr, r_idx_ptr, r_count_ptr,
                               row_max_ptr, num_chunks, BLOCK_C: tl.constexpr,
                               BLOCK_P: tl.constexpr, F: tl.constexpr, R: tl.constexpr):
        # Program row: the row's raw maximum and the frontier of its chunks' points, which is
        # the row's own frontier as long as its points' raw values stay below the last point
        # of every chunk that did not fit its F (beyond it that chunk's missing points could
        # be next). r_count: the points stored, negated when the frontier may go on past them.
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK_C)
        maxima = tl.load(maxes_ptr + row * num_chunks + c, mask=c < num_chunks,
                         other=float("-inf"))
        tl.store(row_max_ptr + row, tl.max(maxima))
        p = tl.arange(0, BLOCK_P)
        chunk = p // F
        count = tl.load(f_count_ptr + row * num_chunks + chunk, mask=chunk < num_chunks,
                        other=0)
        valid = (chunk < num_chunks) & (p % F < count)
        base = row * num_chunks * F
        raw = tl.load(f_raw_ptr + base + p, mask=valid, other=float("-inf"))
        score = tl.load(f_score_ptr + base + p, mask=valid, other=float("-inf"))
        idx = tl.load(f_idx_ptr + base + p, mask=valid, other=2147483647)
        out = row * R
        if tl.load(temps_ptr + row) == 0.0:
            first, best = _first_max(score, idx, 2147483647)
            tl.store(r_raw_ptr + out, best)
            tl.store(r_score_ptr + out, best)
            tl.store(r_idx_ptr + out, first)
            tl.store(r_count_ptr + row, 1)
        else:
            stop_at = tl.min(tl.where(valid & (count > F) & (p % F == F - 1), raw,
                                      float("inf")))
            n, more = _frontier_points(raw, score, valid, f_raw_ptr + base, f_idx_ptr + base,
                                       r_raw_ptr + out, r_score_ptr + out, r_idx_ptr + out, R,
                                       stop_at, True)
            tl.store(r_count_ptr + row, tl.where(more | (stop_at < float("inf")), -n, n))

    @triton.jit(do_not_specialize=["temps_ptr", "top_ps_ptr"])
    def _frontier_mass_kernel(logits_ptr, temps_ptr, top_ps_ptr, r_raw_ptr, r_count_ptr,
                              row_max_ptr, masses_ptr, vocab, stride_row, BLOCK: tl.constexpr,
                              R: tl.constexpr):
        # Program (row, chunk) of a row with top-p: the chunk's e = exp(x - x_max) summed, then
        # over the tokens above each point of the row's frontier (strictly greater raw values).
        row64, idx, raw, out = _load_chunk(logits_ptr, vocab, stride_row, BLOCK)
        row = tl.program_id(0)
        temp = tl.load(temps_ptr + row)
        if (temp != 0.0) & (tl.load(top_ps_ptr + row) < 1.0):
            scale = 1.4426950408889634 / temp
            e = tl.where(raw > float("-inf"),
                         tl.exp2((raw - tl.load(row_max_ptr + row)) * scale), 0.0)
            masses = masses_ptr + out * (R + 1)
            tl.store(masses, tl.sum(e))
            n = tl.abs(tl.load(r_count_ptr + row))
            for j in range(n):
                t = tl.load(r_raw_ptr + row64 * R + j)
                tl.store(masses + 1 + j, tl.sum(tl.where(raw > t, e, 0.0)))

    @triton.jit(do_not_specialize=["temps_ptr", "top_ks_ptr", "top_ps_ptr", "min_ps_ptr",
                                   "seeds_ptr", "offsets_ptr", "vocab_start"])
    def _frontier_pick_kernel(
        r_raw_ptr, r_score_ptr, r_idx_ptr, r_count_ptr, row_max_ptr, masses_ptr, maxes_ptr,
        sums_ptr, logits_ptr, temps_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, seeds_ptr,
        offsets_ptr, tokens_ptr, logprobs_ptr, lse_ptr, scores_ptr, num_chunks, vocab,
        stride_row, vocab_start, resolution, BLOCK_C: tl.constexpr, R: tl.constexpr,
        LOGPROBS: tl.constexpr, BLOCK: tl.constexpr, MAX_PROBES: tl.constexpr,
    ):
        # Program row: the first frontier point that top-p (its mass above <= top_p * Z) and
        # min-p keep. A row whose stored points are all cut while its frontier may go on
        # (rare: a chunk or the row with more points than F or R) is sampled by _sample_row,
        # the full kernel's walk, here.
        row = tl.program_id(0)
        row64 = row.to(tl.int64)
        temp = tl.load(temps_ptr + row)
        count = tl.load(r_count_ptr + row)
        n = tl.abs(count)
        token = tl.load(r_idx_ptr + row64 * R)
        score = tl.load(r_score_ptr + row64 * R)
        found = ((temp == 0.0) & (n > 0)).to(tl.int32)
        if temp != 0.0:
            top_p = tl.load(top_ps_ptr + row)
            min_p = tl.load(min_ps_ptr + row)
            inv_temp = tl.math.div_rn(tl.full((), 1.0, tl.float32), temp)
            x_max = scaled(tl.load(row_max_ptr + row), inv_temp)
            log_min_p = tl.where(min_p > 0.0, tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))
            c = tl.arange(0, BLOCK_C)
            masses = masses_ptr + (row64 * num_chunks + c) * (R + 1)
            cut = top_p < 1.0
            limit = tl.full((), 0.0, tl.float32)
            if cut:
                limit = top_p * tl.sum(tl.load(masses, mask=c < num_chunks, other=0.0))
            j = tl.full((), 0, tl.int32)
            while (j < n) & (found == 0):
                ok = (scaled(tl.load(r_raw_ptr + row64 * R + j), inv_temp) - x_max) >= log_min_p
                if cut:
                    above = tl.sum(tl.load(masses + 1 + j, mask=c < num_chunks, other=0.0))
                    ok &= above <= limit
                if ok:
                    found = tl.full((), 1, tl.int32)
                    token = tl.load(r_idx_ptr + row64 * R + j)
                    score = tl.load(r_score_ptr + row64 * R + j)
                j += 1
        if (found != 0) | (count == 0):
            if count == 0:  # no finite value in the row: the full kernel's token 0, -inf
                token = 0
                score = float("-inf")
            tl.store(tokens_ptr + row, token.to(tl.int64))
            tl.store(scores_ptr + row, score)
            if LOGPROBS:
                c = tl.arange(0, BLOCK_C)
                maxima = tl.load(maxes_ptr + row64 * num_chunks + c, mask=c < num_chunks,
                                 other=float("-inf"))
                sums = tl.load(sums_ptr + row64 * num_chunks + c, mask=c < num_chunks,
                               other=0.0)
                m = tl.max(maxima)
                lse = m + tl.log(tl.sum(sums * tl.exp(maxima - m)))
                tl.store(lse_ptr + row, lse)
                raw_token = tl.load(logits_ptr + row64 * stride_row + token).to(tl.float32)
                tl.store(logprobs_ptr + row, raw_token - lse)
        else:
            _sample_row(
                row, logits_ptr, temps_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, seeds_ptr,
                offsets_ptr, tokens_ptr, logprobs_ptr, scores_ptr, tokens_ptr, lse_ptr,
                tokens_ptr, scores_ptr, vocab, stride_row, vocab_start, 0, resolution,
                False, LOGPROBS, False, BLOCK, MAX_PROBES,
            )


# Passes of mass probes at most before the top-p search's exact passes, and the relative spacing
# of each logits dtype (a bracket narrower than it around its values holds about two of them).
MAX_PROBES = 6
_RESOLUTION = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


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
    if batch > 0:
        grid = (min(batch, programs_per_sm * num_sms(dev)),)
        _sample_kernel[grid](
            logits, temperatures, top_ks, top_ps, min_ps, seeds, offsets,
            tokens, token_logprobs, top_vals, top_ids, lse,
            allowed if allowed is not None else tokens,
            scores, batch, vocab, logits.stride(0), vocab_start, num_logprobs,
            _RESOLUTION[logits.dtype], TOP_N=num_logprobs > 0,
            LOGPROBS=logprobs or num_logprobs > 0,
            WRITE_ALLOWED=allowed is not None, BLOCK=block, MAX_PROBES=MAX_PROBES,
            num_warps=num_warps,
        )
    if num_logprobs == 0:
        return FusedSample(tokens, token_logprobs if logprobs else None, None, None, scores)
    # The kernel gathers the top-n in vocabulary order; ordering 2n values is a tiny sort (a
    # stable one: of tied values, those of the lowest token ids come first).
    top_vals, order = top_vals.sort(dim=1, descending=True, stable=True)
    top_vals, top_ids = top_vals[:, :num_logprobs], top_ids.gather(1, order[:, :num_logprobs])
    return FusedSample(tokens, token_logprobs, top_vals - lse[:, None], top_ids, scores)


def argmax_fused(logits: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """logits [batch, vocab] (fp32/bf16/fp16, rows may be strided) -> int64 [batch], equal to
    logits.argmax(dim=-1): each row's first maximum, a NaN counting as the maximum. Chunks of
    `block` columns are reduced side by side, then each row's chunks (two launches)."""
    assert triton is not None, "argmax_fused needs triton; use argmax_ref"
    assert logits.dim() == 2 and logits.stride(1) == 1, (logits.shape, logits.stride())
    batch, vocab = logits.shape
    dev = logits.device
    assert vocab > 0, "argmax of an empty row"
    tokens = torch.empty(batch, dtype=torch.int64, device=dev)
    if batch == 0:
        return tokens
    num_chunks = triton.cdiv(vocab, block)
    vals = torch.empty(batch, num_chunks, dtype=torch.float32, device=dev)
    idx = torch.empty(batch, num_chunks, dtype=torch.int32, device=dev)
    _argmax_chunks_kernel[(batch, num_chunks)](
        logits, vals, idx, vocab, logits.stride(0), BLOCK=block, num_warps=4
    )
    _argmax_merge_kernel[(batch,)](
        vals, idx, tokens, tokens, vals, vals, logits, vals, vals, vals, idx, vals, tokens,
        num_chunks, logits.stride(0), 0, BLOCK_C=triton.next_power_of_2(num_chunks),
        SCORES=False, LOGPROBS=False, BLOCK_T=0, num_warps=1,
    )  # fmt: skip
    return tokens


def _draw_chunked(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    min_ps: torch.Tensor | None,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    vocab_start: int,
    block: int,
    num_logprobs: int,
    logprobs: bool,
) -> FusedSample:
    """sample_fused for rows without top-k or top-p, in chunks of `block` columns side by side:
    _chunk_stats_kernel when min-p (min_ps not None) or logprobs need the rows' maxima or sums,
    _draw_chunks_kernel (with the chunks' candidates for top logprobs), then the chunks' merge
    (two to three launches)."""
    batch, vocab = logits.shape
    dev = logits.device
    tokens = torch.empty(batch, dtype=torch.int64, device=dev)
    scores = torch.empty(batch, dtype=torch.float32, device=dev)
    logprobs = logprobs or num_logprobs > 0
    token_logprobs = torch.empty(batch, dtype=torch.float32, device=dev) if logprobs else None
    lse = torch.empty(batch, dtype=torch.float32, device=dev) if logprobs else None
    num_chunks = triton.cdiv(vocab, block)
    top_lp = top_tok = None
    if num_logprobs:
        top_lp = torch.empty(batch, num_logprobs, dtype=torch.float32, device=dev)
        top_tok = torch.empty(batch, num_logprobs, dtype=torch.int64, device=dev)
    if batch == 0:
        return FusedSample(tokens, token_logprobs, top_lp, top_tok, scores)
    vals = torch.empty(batch, num_chunks, dtype=torch.float32, device=dev)
    idx = torch.empty(batch, num_chunks, dtype=torch.int32, device=dev)
    top_vals, top_ids = vals, idx
    if num_logprobs:
        top_vals = torch.empty(batch, num_chunks * num_logprobs, dtype=torch.float32, device=dev)
        top_ids = torch.empty(batch, num_chunks * num_logprobs, dtype=torch.int32, device=dev)
    maxes = sums = vals
    block_c = triton.next_power_of_2(num_chunks)
    if min_ps is not None or logprobs:
        maxes = torch.empty(batch, num_chunks, dtype=torch.float32, device=dev)
        sums = torch.empty_like(maxes) if logprobs else maxes
        _chunk_stats_kernel[(batch, num_chunks)](
            logits, maxes, sums, vocab, logits.stride(0), BLOCK=block, SUMS=logprobs,
            num_warps=4,
        )  # fmt: skip
    _draw_chunks_kernel[(batch, num_chunks)](
        logits, temperatures, temperatures if min_ps is None else min_ps, seeds, offsets, maxes,
        vals, idx, top_vals, top_ids, vocab, logits.stride(0), vocab_start, num_logprobs,
        BLOCK=block, MIN_P=min_ps is not None, BLOCK_C=block_c, TOP_N=num_logprobs > 0,
        num_warps=4,
    )  # fmt: skip
    _argmax_merge_kernel[(batch,)](
        vals, idx, tokens, scores, maxes, sums, logits,
        scores if token_logprobs is None else token_logprobs, scores if lse is None else lse,
        top_vals, top_ids, scores if top_lp is None else top_lp,
        tokens if top_tok is None else top_tok, num_chunks, logits.stride(0), num_logprobs,
        BLOCK_C=block_c, SCORES=True, LOGPROBS=logprobs,
        BLOCK_T=triton.next_power_of_2(num_chunks * num_logprobs) if num_logprobs else 0,
        num_warps=1 if num_chunks * num_logprobs <= 256 else 4,
    )  # fmt: skip
    return FusedSample(tokens, token_logprobs, top_lp, top_tok, scores)


# Frontier points kept per chunk (F) and per row (R) by the top-p draw in chunks: a chunk of
# 2,048 random values has ~2-7, a flat row of 152k ~12; a row past them takes the full walk.
FRONTIER = (16, 32)


def _draw_frontier(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    vocab_start: int,
    block: int | None,
    logprobs: bool,
    frontier: tuple[int, int],
) -> FusedSample:
    """sample_fused for rows without top-k, in chunks of `block` (2048 unless given) columns side
    by side, four launches: each chunk's frontier (_frontier_chunks_kernel), each row's
    (_frontier_merge_kernel), the masses above its points (_frontier_mass_kernel) and the
    pick (_frontier_pick_kernel)."""
    batch, vocab = logits.shape
    dev = logits.device
    f, r = frontier
    chunk = block or 2048
    num_chunks = triton.cdiv(vocab, chunk)
    tokens = torch.empty(batch, dtype=torch.int64, device=dev)
    scores = torch.empty(batch, dtype=torch.float32, device=dev)
    token_logprobs = torch.empty(batch, dtype=torch.float32, device=dev) if logprobs else None
    lse = torch.empty(batch, dtype=torch.float32, device=dev) if logprobs else None
    if batch == 0:
        return FusedSample(tokens, token_logprobs, None, None, scores)
    f32, i32 = torch.float32, torch.int32
    maxes = torch.empty(batch, num_chunks, dtype=f32, device=dev)
    sums = torch.empty_like(maxes) if logprobs else maxes
    f_raw = torch.empty(batch, num_chunks, f, dtype=f32, device=dev)
    f_score = torch.empty_like(f_raw)
    f_idx = torch.empty(batch, num_chunks, f, dtype=i32, device=dev)
    f_count = torch.empty(batch, num_chunks, dtype=i32, device=dev)
    r_raw = torch.empty(batch, r, dtype=f32, device=dev)
    r_score = torch.empty_like(r_raw)
    r_idx = torch.empty(batch, r, dtype=i32, device=dev)
    r_count = torch.empty(batch, dtype=i32, device=dev)
    row_max = torch.empty(batch, dtype=f32, device=dev)
    masses = torch.empty(batch, num_chunks, r + 1, dtype=f32, device=dev)
    block_c = triton.next_power_of_2(num_chunks)
    stride = logits.stride(0)
    _frontier_chunks_kernel[(batch, num_chunks)](
        logits, temperatures, seeds, offsets, maxes, sums, f_raw, f_score, f_idx, f_count,
        vocab, stride, vocab_start, BLOCK=chunk, F=f, SUMS=logprobs, num_warps=4,
    )  # fmt: skip
    _frontier_merge_kernel[(batch,)](
        f_raw, f_score, f_idx, f_count, maxes, temperatures, r_raw, r_score, r_idx, r_count,
        row_max, num_chunks, BLOCK_C=block_c, BLOCK_P=triton.next_power_of_2(num_chunks * f),
        F=f, R=r, num_warps=4,
    )  # fmt: skip
    _frontier_mass_kernel[(batch, num_chunks)](
        logits, temperatures, top_ps, r_raw, r_count, row_max, masses, vocab, stride,
        BLOCK=chunk, R=r, num_warps=4,
    )  # fmt: skip
    full_block = block or min(4096, triton.next_power_of_2(vocab))
    _frontier_pick_kernel[(batch,)](
        r_raw, r_score, r_idx, r_count, row_max, masses, maxes, sums, logits, temperatures,
        top_ks, top_ps, min_ps, seeds, offsets, tokens,
        scores if token_logprobs is None else token_logprobs, scores if lse is None else lse,
        scores, num_chunks, vocab, stride, vocab_start, _RESOLUTION[logits.dtype],
        BLOCK_C=block_c, R=r, LOGPROBS=logprobs, BLOCK=full_block, MAX_PROBES=MAX_PROBES,
        num_warps=16 if full_block >= 4096 else 4,
    )  # fmt: skip
    return FusedSample(tokens, token_logprobs, None, None, scores)


def sample_fused(
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
    block: int | None = None,
    num_warps: int | None = None,
    programs_per_sm: int = 1,
    logprobs: bool = True,
    plain: bool = False,
    min_p: bool = True,
    top_k: bool = True,
    frontier: tuple[int, int] = FRONTIER,
) -> FusedSample:
    """Sample one token per row of logits [batch, vocab] (fp32/bf16/fp16, rows may be strided).

    Per row, on the logits' device: temperatures fp32 (0 = greedy), top_ks int32 (<= 0 or >=
    vocab = off), top_ps fp32 (1 = off), min_ps fp32 (0 = off), seeds int64, offsets int64.
    The noise of a row is keyed by (seed, offset): the caller folds the sample index and the
    output position into offset (e.g. position * n + sample_index), so a row's draw is
    reproducible and independent of the batch. num_logprobs > 0 also returns the top
    num_logprobs raw logprobs; logprobs=False leaves out the sampled tokens' own (then
    FusedSample.logprobs is None) unless num_logprobs > 0, and the pass that sums the row's
    softmax with it. The module docstring states the exact semantics.

    vocab_start: the columns are token ids vocab_start.. of a larger vocabulary (a
    tensor-parallel rank's shard): the noise is that of those ids. Token ids returned are
    column indices; with no top-k, top-p or min-p, the shard of the largest score (the first
    on ties) holds the full row's token (see FusedSample.scores).

    plain: the caller knows no row has top-k or top-p; min_p: whether a row may have min-p.
    Such rows need no search: their draw runs in chunks of `block` columns (2048 unless given)
    side by side, with the rows' maxima (min-p) and softmax sums and top values (logprobs)
    from a pass of chunks before it. The same tokens and scores as the full kernel and its
    logprobs within rounding, in a fraction of its time (one program walking a whole row is
    bound by its loads' latency).

    top_k: whether a row may have top-k. Without it (and without top logprobs) rows with top-p
    draw in chunks too (_draw_frontier): the same tokens as the full kernel, found from the
    masses above a few candidate tokens instead of a search for the cut (frontier: the
    candidates kept per chunk and per row; tests make them small to reach the fallback).
    """
    if plain:
        return _draw_chunked(logits, temperatures, min_ps if min_p else None, seeds, offsets,
                             vocab_start, block or 2048, num_logprobs, logprobs)
    if not top_k and num_logprobs == 0:
        return _draw_frontier(logits, temperatures, top_ks, top_ps, min_ps, seeds, offsets,
                              vocab_start, block, logprobs, frontier)
    return _launch(logits, temperatures, top_ks, top_ps, min_ps, seeds, offsets, num_logprobs,
                   None, block, num_warps, vocab_start, programs_per_sm, logprobs)


def allowed_mask_fused(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    *,
    block: int | None = None,
) -> torch.Tensor:
    """The kernel's allowed set [batch, vocab] bool, for comparing with allowed_mask_ref."""
    batch, vocab = logits.shape
    allowed = torch.zeros(batch, vocab, dtype=torch.int8, device=logits.device)
    zeros = torch.zeros(batch, dtype=torch.int64, device=logits.device)
    _launch(logits, temperatures, top_ks, top_ps, min_ps, zeros, zeros, 0, allowed, block, None)
    return allowed.bool()
