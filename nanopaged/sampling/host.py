"""The host path: rows that need more than one plain token (and its raw logprobs) each — a
parent about to fork into n samples, beams, logit controls, penalties with logprobs — get a
SampleOutput each. Plain steps keep the Sampler's fast path, which returns bare token ids."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from nanopaged.kernels.sampler import apply_bitmask_ref
from nanopaged.logits_processors import apply_logit_controls
from nanopaged.sampling.ops import TokenMask, sample, sampling_tensors
from nanopaged.sampling.output import SampleOutput
from nanopaged.sampling.penalties import PenaltyCounts, mask_early_stops, penalize
from nanopaged.sampling.rows import row_stream

if TYPE_CHECKING:
    from nanopaged.engine.sequence import Sequence


def _is_beam(seq: Sequence) -> bool:
    return seq.group is not None and seq.group.is_beam_search


def sample_sequences(
    logits: torch.Tensor,
    seqs: list[Sequence],
    eos_token_ids: set[int],
    pending: torch.Tensor | None = None,
    penalty_counts: PenaltyCounts | None = None,
    mask: TokenMask | None = None,
) -> list[SampleOutput]:
    """One SampleOutput per sequence (one logits row each, logits: [len(seqs), vocab] fp32).
    pending, penalty_counts: the previous step's sampled tokens on the device and the
    Sampler's counts, for penalize; mask: the rows' grammar masks (structured outputs).

    A beam gets its 2 * beam_width most likely tokens under the raw distribution. A parent that
    forks into n samples draws n tokens from its row, sample j from its own random stream.
    Logprobs are those of the raw model distribution (before penalties and temperature).
    An output's `finite` says whether finite logits decided its tokens.
    """
    if mask is not None:  # logprobs are then those of the masked distribution
        logits = apply_bitmask_ref(logits, mask.words, mask.rows)
    want = [_is_beam(s) or s.row.logprobs is not None for s in seqs]
    # raw: [len(seqs), vocab] log-probabilities of the model's own distribution
    raw = logits.log_softmax(dim=-1) if any(want) else None
    outputs: list[SampleOutput | None] = [None] * len(seqs)
    beam_rows = [i for i, s in enumerate(seqs) if _is_beam(s)]
    if beam_rows:
        for i, out in zip(beam_rows, _beam_candidates(raw, beam_rows, seqs)):
            outputs[i] = out
    rows = [i for i in range(len(seqs)) if outputs[i] is None]
    if rows:
        sampled = _draw(logits, raw, rows, seqs, eos_token_ids, pending, penalty_counts)
        for i, out in zip(rows, sampled):
            outputs[i] = out
    return outputs


def _beam_candidates(
    raw: torch.Tensor, beam_rows: list[int], seqs: list[Sequence]
) -> list[SampleOutput]:
    """Each beam's 2 * beam_width best tokens under the raw distribution (raw: [rows, vocab])."""
    widths = [seqs[i].group.beam_params.beam_width * 2 for i in beam_rows]
    k = min(max(widths), raw.shape[-1])
    values, tokens = raw[torch.tensor(beam_rows, device=raw.device)].topk(k, dim=-1)
    values, tokens = values.tolist(), tokens.tolist()
    out = []
    for r, width in enumerate(widths):
        w = min(width, raw.shape[-1])
        # A NaN or infinite logit makes the row's log_softmax NaN, its best candidate too.
        out.append(SampleOutput(token_ids=tokens[r][:w], logprobs=values[r][:w],
                                finite=math.isfinite(values[r][0])))  # fmt: skip
    return out


def _draw(
    logits: torch.Tensor,
    raw: torch.Tensor | None,
    rows: list[int],
    seqs: list[Sequence],
    eos_token_ids: set[int],
    pending: torch.Tensor | None,
    penalty_counts: PenaltyCounts | None,
) -> list[SampleOutput]:
    """Sample the rows `rows` of logits (a parent about to fork: one token per sample)."""
    dev = logits.device
    row_seqs = [seqs[i] for i in rows]
    sub = logits[torch.tensor(rows, device=dev)] if len(rows) < len(seqs) else logits
    sub = penalize(apply_logit_controls(sub, row_seqs), row_seqs, pending, penalty_counts)
    if sub is logits:
        sub = logits.clone()
    mask_early_stops(sub, row_seqs, eos_token_ids)
    # A parent about to fork draws one token per sample from its row.
    repeats = [
        s.group.num_samples if s.group is not None and not s.group.forked else 1
        for s in row_seqs
    ]
    expand = [r for r, k in enumerate(repeats) for _ in range(k)]
    params, classes, seeds, offsets = [], [], [], []
    for s, k in zip(row_seqs, repeats):
        for j in range(k):
            params.append(s.sampling_params)
            classes.append(s.row)
            seeds.append(row_stream(s, j if k > 1 else None))
            offsets.append(s.num_output_tokens)
    if len(expand) > len(rows):
        sub = sub[torch.tensor(expand, device=dev)]
    st = sampling_tensors(params, seeds, offsets, dev, rows=classes)
    sampled = sample(sub, st).token_ids
    # Each token's logit (after the controls and penalties) comes back with it, in one copy:
    # not finite when NaN or infinite logits decided it (see DeviceSamples).
    won = sub.gather(1, sampled[:, None])[:, 0]
    tokens, finite = torch.stack([sampled, won.isfinite().long()]).tolist()
    source = [rows[r] for r in expand]  # each drawn token's row of logits / raw
    lp = _raw_logprobs(raw, source, tokens, seqs)
    outputs, start = [], 0
    for i, k in zip(rows, repeats):
        span = range(start, start + k)
        start += k
        out = SampleOutput(token_ids=[tokens[e] for e in span],
                           finite=all(finite[e] for e in span))  # fmt: skip
        if seqs[i].row.logprobs is not None:
            out.logprobs = [lp[e][0] for e in span]
            out.top_logprobs = [lp[e][1] for e in span]
            out.top_ranks = [lp[e][2] for e in span]
        outputs.append(out)
    return outputs


def _raw_logprobs(
    raw: torch.Tensor | None, source: list[int], tokens: list[int], seqs: list[Sequence]
) -> dict[int, tuple[float, dict[int, float], dict[int, int]]]:
    """Per drawn token e (of row source[e]) whose sequence wants logprobs: its raw logprob,
    the row's top-k plus the token, and their 1-based ranks (ties share the best rank)."""
    picks = [e for e, i in enumerate(source) if seqs[i].row.logprobs is not None]
    if not picks:
        return {}
    dev = raw.device
    lp = raw[torch.tensor([source[e] for e in picks], device=dev)]  # [len(picks), vocab]
    picked_ids = torch.tensor([tokens[e] for e in picks], device=dev)
    picked = lp.gather(1, picked_ids[:, None]).squeeze(1)
    k = min(max(seqs[source[e]].row.logprobs or 0 for e in picks), lp.shape[-1])
    top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
    picked_rank = ((lp > picked[:, None]).sum(dim=-1) + 1).tolist()
    picked, top_v, top_i = picked.tolist(), top_v.tolist(), top_i.tolist()
    out = {}
    for n, e in enumerate(picks):
        want = seqs[source[e]].row.logprobs or 0
        top = dict(zip(top_i[n][:want], top_v[n][:want]))
        rank = {t: j + 1 for j, t in enumerate(top_i[n][:want])}
        top[tokens[e]] = picked[n]
        rank.setdefault(tokens[e], picked_rank[n])
        out[e] = (picked[n], top, rank)
    return out
