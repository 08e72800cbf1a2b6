"""Sampling for steps that need more than one token per row: forks (n > 1), beams, logprobs,
penalties, logit controls. Plain steps keep the runner's fast path, which returns bare token ids."""

from __future__ import annotations

import math

import torch
import xxhash

from nanopaged.engine.penalty_counts import PenaltyCounts
from nanopaged.engine.sample_output import SampleOutput
from nanopaged.engine.sequence import Sequence
from nanopaged.layers.backend import backend_for
from nanopaged.layers.sampler import SamplingTensors, sample
from nanopaged.logits_processors import apply_logit_controls
from nanopaged.sampling_params import SamplingParams


def needs_sample_outputs(seqs: list[Sequence]) -> bool:
    """Whether any of seqs needs this module rather than one plain token (and its raw
    logprobs) per row: a fork, a beam, logit controls, penalties with logprobs (reported
    before the penalties), or logprobs while min_tokens masks the row (the plain path would
    report the masked distribution). Penalties alone stay plain: see penalize's pending."""
    for seq in seqs:
        p = seq.sampling_params
        group = seq.group
        if group is not None:
            if group.needs_sample_outputs:
                return True
        elif p.penalties_need_outputs or p.has_logit_controls:
            return True
        if p.logprobs is not None and seq.num_output_tokens < p.min_tokens:
            return True
    return False


def sample_seed(seed: int, index: int) -> int:
    """The random stream of sample `index` of a request seeded with `seed`, as a signed int64.

    Sample 0 uses the seed itself (as n = 1 does); the others a hash of (seed, index), so the
    samples differ from each other and each is reproducible whatever else is in the batch.
    """
    if index:
        seed = xxhash.xxh64_intdigest(f"{seed}:{index}".encode())
    return seed - (1 << 64) if seed >= 1 << 63 else seed


class SlotSettings:
    """Sampling settings of up to `slots` rows in persistent device tensors, which CUDA graphs'
    captured samplers read (engine/cuda_graph.py). sampling_tensors(into=...) rewrites them
    when a step's sequences change; rows past its batch are greedy."""

    def __init__(self, slots: int, device: torch.device) -> None:
        self.values = torch.zeros(3, slots, dtype=torch.float32, device=device)  # temp, p, min-p
        self.values[1] = 1.0
        self.ints = torch.zeros(3, slots, dtype=torch.int64, device=device)  # top-k, seed, offset
        self.top_ks = torch.zeros(slots, dtype=torch.int32, device=device)

    @property
    def slots(self) -> int:
        return self.values.shape[1]


def sampling_tensors(
    params: list[SamplingParams],
    seeds: list[int],
    offsets: list[int],
    device: torch.device,
    into: SlotSettings | None = None,
) -> SamplingTensors:
    """One step's per-row settings, in two host-to-device copies (into: written to those
    persistent tensors, the returned ones their first rows)."""
    n = len(params)
    pad = 0 if into is None else into.slots - n
    if pad < 0:
        raise ValueError(f"{n} rows of sampling settings do not fit {into.slots} slots")
    # values: [3, batch] = temperature, top_p, min_p; ints: [3, batch] = top_k, seed, offset
    values = torch.tensor(
        [[p.temperature for p in params] + [0.0] * pad,
         [p.top_p for p in params] + [1.0] * pad,
         [p.min_p for p in params] + [0.0] * pad],
        dtype=torch.float32,
    )  # fmt: skip
    ints = torch.tensor(
        [[max(p.top_k, 0) for p in params] + [0] * pad, seeds + [0] * pad, offsets + [0] * pad],
        dtype=torch.int64,
    )
    if device.type == "cuda":  # from page-locked memory, so the copy does not wait
        values, ints = values.pin_memory(), ints.pin_memory()
    if into is None:
        values = values.to(device, non_blocking=True)
        ints = ints.to(device, non_blocking=True)
        top_ks = ints[0].to(torch.int32)
    else:
        into.values.copy_(values, non_blocking=True)
        into.ints.copy_(ints, non_blocking=True)
        into.top_ks.copy_(into.ints[0])
        values, ints, top_ks = into.values[:, :n], into.ints[:, :n], into.top_ks[:n]
    return SamplingTensors(
        temperatures=values[0],
        top_ps=values[1],
        min_ps=values[2],
        top_ks=top_ks,
        seeds=ints[1],
        offsets=ints[2],
        all_greedy=all(p.greedy for p in params),
        all_plain=all(p.top_k == -1 and p.top_p == 1.0 for p in params),
        any_min_p=any(p.min_p > 0.0 for p in params),
        any_top_k=any(p.top_k > 0 for p in params),
    )


def row_stream(seq: Sequence, index: int | None = None) -> int:
    """The seed of seq's random stream (of sample `index` for a parent about to fork)."""
    return sample_seed(seq.seed, seq.index if index is None else index)


def penalize(
    logits: torch.Tensor,
    seqs: list[Sequence],
    pending: torch.Tensor | None = None,
    counts: PenaltyCounts | None = None,
) -> torch.Tensor:
    """Apply each sequence's presence/frequency/repetition penalties to its row of logits.

    pending: the previous step's sampled tokens on the device (asynchronous scheduling): a
    sequence whose newest token is still there (pending_row) counts it from there, so the
    counts equal those of a synchronous step. counts: the runner's PenaltyCounts, which keeps
    each sequence's counts on the device from step to step (without it they are built here).
    """
    rows = [i for i, s in enumerate(seqs) if s.sampling_params.has_penalties]
    if not rows:
        return logits
    dev = logits.device
    pen = [seqs[i] for i in rows]
    if counts is None:
        counts = PenaltyCounts(logits.shape[-1], dev)
    state_rows = counts.update(pen, pending)
    # [3, n] presence, frequency, repetition; with the row indices: one copy to the device
    host = torch.tensor(
        [
            [s.sampling_params.presence_penalty for s in pen],
            [s.sampling_params.frequency_penalty for s in pen],
            [s.sampling_params.repetition_penalty for s in pen],
            rows,
            state_rows,
        ],
        dtype=torch.float64,
    )
    if dev.type == "cuda":
        host = host.pin_memory()
    both = host.to(dev, non_blocking=True)
    penalties = both[:3].float()
    logits = logits.to(torch.float32, copy=True)  # one copy, whatever the logits' dtype
    backend_for(dev).penalize_rows(logits, both[3].long(), both[4].long(), counts.counts,
                                   counts.prompt, penalties)  # fmt: skip
    return logits


def mask_early_stops(logits: torch.Tensor, seqs: list[Sequence], eos: set[int]) -> None:
    """Forbid EOS and stop tokens to sequences that have not reached min_tokens (in place):
    one index copy from page-locked memory and one kernel for all rows, so the step stays
    asynchronous (an index list per row copied from pageable memory waited for the device)."""
    rows: list[int] = []
    cols: list[int] = []
    for i, seq in enumerate(seqs):
        p = seq.sampling_params
        if seq.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos))
            rows += [i] * len(banned)
            cols += banned
    if not rows:
        return
    # index: [2, n] = rows, token ids
    index = torch.tensor([rows, cols], dtype=torch.long)
    if logits.is_cuda:
        index = index.pin_memory()
    index = index.to(logits.device, non_blocking=True)
    logits.index_put_((index[0], index[1]), logits.new_full((), float("-inf")))


def sample_sequences(
    logits: torch.Tensor,
    seqs: list[Sequence],
    eos_token_ids: set[int],
    pending: torch.Tensor | None = None,
    penalty_counts: PenaltyCounts | None = None,
) -> list[SampleOutput]:
    """One SampleOutput per sequence (one logits row each, logits: [len(seqs), vocab] fp32).
    pending, penalty_counts: the previous step's sampled tokens on the device and the
    runner's counts, for penalize.

    A beam gets its 2 * beam_width most likely tokens under the raw distribution. A parent that
    forks into n samples draws n tokens from its row, sample j from its own random stream.
    Logprobs are those of the raw model distribution (before penalties and temperature).
    An output's `finite` says whether finite logits decided its tokens.
    """
    vocab, dev = logits.shape[-1], logits.device
    want_logprobs = [
        (s.group is not None and s.group.is_beam_search) or s.sampling_params.logprobs is not None
        for s in seqs
    ]
    # raw: [len(seqs), vocab] log-probabilities of the model's own distribution
    raw = logits.log_softmax(dim=-1) if any(want_logprobs) else None
    outputs: list[SampleOutput | None] = [None] * len(seqs)

    beam_rows = [i for i, s in enumerate(seqs) if s.group is not None and s.group.is_beam_search]
    if beam_rows:
        widths = [2 * seqs[i].group.beam_params.beam_width for i in beam_rows]
        k = min(max(widths), vocab)
        values, tokens = raw[torch.tensor(beam_rows, device=dev)].topk(k, dim=-1)
        values, tokens = values.tolist(), tokens.tolist()
        for r, i in enumerate(beam_rows):
            w = min(widths[r], vocab)
            # A NaN or infinite logit makes the row's log_softmax NaN, its best candidate too.
            outputs[i] = SampleOutput(token_ids=tokens[r][:w], logprobs=values[r][:w],
                                      finite=math.isfinite(values[r][0]))  # fmt: skip

    rows = [i for i in range(len(seqs)) if outputs[i] is None]
    if not rows:
        return outputs
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
    params, seeds, offsets = [], [], []
    for s, k in zip(row_seqs, repeats):
        for j in range(k):
            params.append(s.sampling_params)
            seeds.append(row_stream(s, j if k > 1 else None))
            offsets.append(s.num_output_tokens)
    if len(expand) > len(rows):
        sub = sub[torch.tensor(expand, device=dev)]
    st = sampling_tensors(params, seeds, offsets, dev)
    sampled = sample(sub, st).token_ids
    # Each token's logit (after the controls and penalties) comes back with it, in one copy:
    # not finite when NaN or infinite logits decided it (see DeviceSamples).
    won = sub.gather(1, sampled[:, None])[:, 0]
    tokens, finite = torch.stack([sampled, won.isfinite().long()]).tolist()

    lp_rows = [r for r in range(len(expand)) if want_logprobs[rows[expand[r]]]]
    sampled_lp: dict[int, float] = {}
    top: dict[int, dict[int, float]] = {}
    ranks: dict[int, dict[int, int]] = {}
    if lp_rows:
        sel = torch.tensor([rows[expand[r]] for r in lp_rows], device=dev)
        lp = raw[sel]  # [len(lp_rows), vocab]
        picked_ids = torch.tensor([tokens[r] for r in lp_rows], device=dev)
        picked = lp.gather(1, picked_ids[:, None]).squeeze(1)
        k = min(max(seqs[rows[expand[r]]].sampling_params.logprobs or 0 for r in lp_rows), vocab)
        top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
        # The sampled token's 1-based rank in the raw distribution (ties share the best rank).
        picked_rank = ((lp > picked[:, None]).sum(dim=-1) + 1).tolist()
        picked, top_v, top_i = picked.tolist(), top_v.tolist(), top_i.tolist()
        for n, r in enumerate(lp_rows):
            want = seqs[rows[expand[r]]].sampling_params.logprobs or 0
            d = dict(zip(top_i[n][:want], top_v[n][:want]))
            rank = {t: j + 1 for j, t in enumerate(top_i[n][:want])}
            d[tokens[r]] = picked[n]
            rank.setdefault(tokens[r], picked_rank[n])
            sampled_lp[r], top[r], ranks[r] = picked[n], d, rank

    start = 0
    for i, k in zip(rows, repeats):
        span = range(start, start + k)
        start += k
        out = SampleOutput(token_ids=[tokens[e] for e in span],
                           finite=all(finite[e] for e in span))  # fmt: skip
        if want_logprobs[i]:
            out.logprobs = [sampled_lp[e] for e in span]
            out.top_logprobs = [top[e] for e in span]
            out.top_ranks = [ranks[e] for e in span]
        outputs[i] = out
    return outputs
