"""Sampling in chunks of a row side by side: argmax_fused, and sample_fused's draws for rows
without top-k (kernels/sampler.py has the semantics, the reference and the full kernel).

One program walking a 152k-entry row is bound by its loads' latency; here programs of BLOCK
columns each reduce their chunk and a per-row program merges the chunks, so one row (a batch-1
step) spreads over the SMs. Every draw computes the full kernel's bits for a token:
- draw_chunked, rows without top-k or top-p: each chunk keeps its best x + noise (after a pass
  that finds the chunks' maxima for min-p's cut and softmax sums for logprobs), the merge
  picks the row's best; top logprobs come from the chunks that can hold them.
- draw_frontier, rows without top-k: under a cut x >= t the draw is, for every t, one of a
  few candidate tokens (each the best score among the tokens above the one before it), so
  the masses above those candidates, summed in one chunked pass, say which one top-p keeps.
"""

from __future__ import annotations

import torch

from nanopaged.kernels.sampler import (
    _RESOLUTION,
    FRONTIER,
    MAX_PROBES,
    FusedSample,
    _launch,
    check_bitmask,
)

try:
    import triton
    import triton.language as tl

    from nanopaged.kernels.hash_rng import noisy_score, row_keys, scaled, uniform
    from nanopaged.kernels.sampler import _bitmask_keep, _sample_row
except ImportError:  # CPU-only installs use sampler.sample_ref / argmax_ref
    triton = None


if triton is not None:

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
    def _mask_chunk(raw, idx, row64, bitmask_ptr, bitmask_rows_ptr, stride_bitmask, vocab,
                    bit_start):
        # raw with -inf where the row's bitmask clears the token (as sampler._load_block).
        mask_row = tl.load(bitmask_rows_ptr + row64)
        bits_ptr = bitmask_ptr + tl.maximum(mask_row, 0).to(tl.int64) * stride_bitmask
        keep = _bitmask_keep(bits_ptr, tl.where(mask_row >= 0, vocab, 0), bit_start, idx)
        return tl.where(keep, raw, float("-inf"))

    @triton.jit
    def _argmax_chunks_kernel(logits_ptr, vals_ptr, idx_ptr, vocab, stride_row, bitmask_ptr,
                              bitmask_rows_ptr, stride_bitmask, BLOCK: tl.constexpr,
                              BITMASK: tl.constexpr):
        # Program (row, chunk): the chunk's first maximum. Chunks of a row run side by side,
        # so one row (a batch-1 decode step) is spread over the SMs, not read by one.
        row64, idx, x, out = _load_chunk(logits_ptr, vocab, stride_row, BLOCK)
        if BITMASK:
            x = _mask_chunk(x, idx, row64, bitmask_ptr, bitmask_rows_ptr, stride_bitmask, vocab,
                            0)
        first, best = _first_max(x, idx, 2147483647)
        tl.store(vals_ptr + out, best)
        tl.store(idx_ptr + out, first)

    @triton.jit
    def _chunk_stats_kernel(logits_ptr, maxes_ptr, sums_ptr, vocab, stride_row, bitmask_ptr,
                            bitmask_rows_ptr, stride_bitmask, vocab_start, BLOCK: tl.constexpr,
                            SUMS: tl.constexpr, BITMASK: tl.constexpr):
        # Program (row, chunk): the chunk's largest raw logit; with SUMS the sum of exp(raw -
        # that maximum) (0 for a chunk all -inf).
        row64, idx, raw, out = _load_chunk(logits_ptr, vocab, stride_row, BLOCK)
        if BITMASK:
            raw = _mask_chunk(raw, idx, row64, bitmask_ptr, bitmask_rows_ptr, stride_bitmask,
                              vocab, vocab_start)
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
                                   "vocab_start", "bitmask_ptr", "bitmask_rows_ptr",
                                   "stride_bitmask"])
    def _draw_chunks_kernel(logits_ptr, temps_ptr, min_ps_ptr, seeds_ptr, offsets_ptr,
                            maxes_ptr, vals_ptr, idx_ptr, top_vals_ptr, top_ids_ptr, vocab,
                            stride_row, vocab_start, num_logprobs, bitmask_ptr,
                            bitmask_rows_ptr, stride_bitmask, BLOCK: tl.constexpr,
                            MIN_P: tl.constexpr, BLOCK_C: tl.constexpr, TOP_N: tl.constexpr,
                            BITMASK: tl.constexpr):
        # Program (row, chunk) of a row with no top-k or top-p: the chunk's best score and its
        # first index, the score computed as _sample_row's last pass does (x + noise over the
        # allowed x, x = raw * (1 / temperature)), or a greedy row's raw maximum as
        # _argmax_chunks_kernel finds it. With MIN_P the row's maximum for the min-p cut comes
        # from the chunks' maxima (_chunk_stats_kernel), and with TOP_N the chunk's candidates
        # for the top logprobs too (_chunk_top_n). One pass, chunks side by side: no row waits
        # on one program's walk through its whole vocabulary.
        row64, idx, raw, out = _load_chunk(logits_ptr, vocab, stride_row, BLOCK)
        if BITMASK:
            raw = _mask_chunk(raw, idx, row64, bitmask_ptr, bitmask_rows_ptr, stride_bitmask,
                              vocab, vocab_start)
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

    # ---- rows with top-p (and min-p) but no top-k: draw_frontier -------------------------
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
        row64, _, raw, out = _load_chunk(logits_ptr, vocab, stride_row, BLOCK)
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
                tokens_ptr, tokens_ptr, 0, False, LOGPROBS, False, BLOCK, MAX_PROBES, False,
            )


def argmax_fused(
    logits: torch.Tensor,
    block: int = 2048,
    bitmask: torch.Tensor | None = None,
    bitmask_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [batch, vocab] (fp32/bf16/fp16, rows may be strided) -> int64 [batch], equal to
    logits.argmax(dim=-1): each row's first maximum, a NaN counting as the maximum. Chunks of
    `block` columns are reduced side by side, then each row's chunks (two launches). With a
    bitmask (sampler.sample_fused's), the argmax of the masked row (argmax_ref's)."""
    assert triton is not None, "argmax_fused needs triton; use argmax_ref"
    assert logits.dim() == 2 and logits.stride(1) == 1, (logits.shape, logits.stride())
    batch, vocab = logits.shape
    dev = logits.device
    assert vocab > 0, "argmax of an empty row"
    tokens = torch.empty(batch, dtype=torch.int64, device=dev)
    if batch == 0:
        return tokens
    if bitmask is not None:
        bitmask_rows = check_bitmask(bitmask, bitmask_rows, batch, vocab, 0, dev)
    num_chunks = triton.cdiv(vocab, block)
    vals = torch.empty(batch, num_chunks, dtype=torch.float32, device=dev)
    idx = torch.empty(batch, num_chunks, dtype=torch.int32, device=dev)
    _argmax_chunks_kernel[(batch, num_chunks)](
        logits, vals, idx, vocab, logits.stride(0), *_bitmask_args(bitmask, bitmask_rows, idx),
        BLOCK=block, BITMASK=bitmask is not None, num_warps=4,
    )  # fmt: skip
    _argmax_merge_kernel[(batch,)](
        vals, idx, tokens, tokens, vals, vals, logits, vals, vals, vals, idx, vals, tokens,
        num_chunks, logits.stride(0), 0, BLOCK_C=triton.next_power_of_2(num_chunks),
        SCORES=False, LOGPROBS=False, BLOCK_T=0, num_warps=1,
    )  # fmt: skip
    return tokens


def _bitmask_args(
    bitmask: torch.Tensor | None, bitmask_rows: torch.Tensor | None, dummy: torch.Tensor
) -> tuple:
    """The (bitmask, bitmask_rows, row stride) arguments of a chunk kernel; without a bitmask
    any tensor stands in (the kernel is compiled without the loads)."""
    if bitmask is None:
        return dummy, dummy, 0
    return bitmask, bitmask_rows, bitmask.stride(0)


def draw_chunked(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    min_ps: torch.Tensor | None,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    vocab_start: int,
    block: int,
    num_logprobs: int,
    logprobs: bool,
    bitmask: torch.Tensor | None = None,
    bitmask_rows: torch.Tensor | None = None,
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
    if bitmask is not None:
        bitmask_rows = check_bitmask(bitmask, bitmask_rows, batch, vocab, vocab_start, dev)
    masking = _bitmask_args(bitmask, bitmask_rows, tokens)
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
            logits, maxes, sums, vocab, logits.stride(0), *masking, vocab_start, BLOCK=block,
            SUMS=logprobs, BITMASK=bitmask is not None, num_warps=4,
        )  # fmt: skip
    _draw_chunks_kernel[(batch, num_chunks)](
        logits, temperatures, temperatures if min_ps is None else min_ps, seeds, offsets, maxes,
        vals, idx, top_vals, top_ids, vocab, logits.stride(0), vocab_start, num_logprobs,
        *masking, BLOCK=block, MIN_P=min_ps is not None, BLOCK_C=block_c,
        TOP_N=num_logprobs > 0, BITMASK=bitmask is not None, num_warps=4,
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


def draw_frontier(
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
    bitmask: torch.Tensor | None = None,
    bitmask_rows: torch.Tensor | None = None,
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
    draw in chunks too (sampler_chunks.draw_frontier): the full kernel's tokens, found from
    the masses above a few candidate tokens instead of a search for the cut (frontier: the
    candidates kept per chunk and per row; tests make them small to reach the fallback).

    bitmask: the allowed tokens of constrained rows (structured outputs), int32 [num_masks,
    ceil(vocab_size / 32)] on the logits' device, bit t % 32 of word t // 32 set = token id t
    allowed; row i takes bitmask row bitmask_rows[i] (int32 [batch], -1: unconstrained, its
    loads predicated off), or row i when bitmask_rows is None. A token it clears is -inf in
    every pass over the row (apply_bitmask_ref): the filters, the draw, greedy and the
    logprobs are the masked row's. None: the kernels are compiled without it. Rows with top-p
    but no top-k take the full kernel when masked.
    """
    if plain:
        return draw_chunked(
            logits, temperatures, min_ps if min_p else None, seeds, offsets, vocab_start,
            block or 2048, num_logprobs, logprobs, bitmask, bitmask_rows,
        )  # fmt: skip
    if not top_k and num_logprobs == 0 and bitmask is None:
        return draw_frontier(
            logits, temperatures, top_ks, top_ps, min_ps, seeds, offsets, vocab_start, block,
            logprobs, frontier,
        )  # fmt: skip
    return _launch(logits, temperatures, top_ks, top_ps, min_ps, seeds, offsets, num_logprobs,
                   None, block, num_warps, vocab_start, programs_per_sm, logprobs, bitmask,
                   bitmask_rows)
