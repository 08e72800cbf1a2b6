"""What a request's rows need from the sampler, decided once when the request joins, and what
one step's rows need together, derived from that.

Every other question the step asks of its rows reads these two objects: whether the step
samples inside its CUDA graph, whether tensor-parallel ranks sample their vocabulary shards,
whether the next step may be planned before this one's samples reach the host (the step is
"plain"), and which path of the fused kernel runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

from nanopaged.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RowClass:
    """A request's sampling needs (the same for each of its sequences)."""

    greedy: bool
    # A top-k, top-p or min-p cut: thresholds over the whole row (no sharded sampling).
    top_k: bool
    top_p: bool
    min_p: bool
    logprobs: int | None
    penalties: bool
    # Sampled on the host path, one SampleOutput per row (sampling/host.py): beams, logit
    # controls, and penalties with logprobs (reported before the penalties).
    host: bool
    # Stop tokens (and EOS) are masked until this many tokens are out.
    min_tokens: int
    # Structured outputs: a grammar's token mask each step, filled on the host from the
    # sequence's matcher once its previous token is known (its step's sampler waits for it).
    constrained: bool = False
    # Its decode rows may carry drafts (speculative decoding): rows drawn from plain logits,
    # with no per-position logprobs, penalties, logit controls or grammar to apply.
    may_speculate: bool = False


def classify(params: SamplingParams, beam: bool = False) -> RowClass:
    """The RowClass of a request sampled with params (beam: a beam search's)."""
    return RowClass(
        greedy=params.greedy,
        top_k=params.top_k > 0,
        top_p=params.top_p < 1.0,
        min_p=params.min_p > 0.0,
        logprobs=params.logprobs,
        penalties=params.has_penalties,
        host=beam or params.penalties_need_outputs or params.has_logit_controls,
        min_tokens=params.min_tokens,
        constrained=params.structured_outputs is not None,
        may_speculate=not (
            beam
            or params.has_penalties
            or params.has_logit_controls
            or params.logprobs is not None
            or params.prompt_logprobs is not None
            or params.structured_outputs is not None
        ),
    )


class Sequence(Protocol):
    """What this module reads of a sequence (engine/sequence.Sequence, which imports it)."""

    row: RowClass
    group: Any  # its SequenceGroup: .forked, False while a parent is still to fork
    seed: int
    index: int

    @property
    def num_output_tokens(self) -> int: ...


def is_early(seq: Sequence) -> bool:
    """Whether seq's stop tokens are still masked this step (min_tokens not reached)."""
    return seq.num_output_tokens < seq.row.min_tokens


def on_host(seq: Sequence) -> bool:
    """Whether seq's row needs the host path this step: its class says so, a parent is about
    to fork into n samples, or its logprobs would otherwise come from a masked row."""
    row = seq.row
    if row.host or (seq.group is not None and not seq.group.forked):
        return True
    return row.logprobs is not None and is_early(seq)


@dataclass(frozen=True, slots=True)
class StepRows:
    """The needs of one step's sampled rows together (StepRows.of)."""

    # Some row takes the host path: the step returns SampleOutputs and runs synchronously.
    host: bool
    # Every row samples one token from its own logits with no logprobs, penalties or
    # min_tokens mask: the sampler may run inside the decode graph (with grammar masks, once
    # they are known: DecodeGraphs).
    graph_safe: bool
    # graph_safe, no grammar, and every row greedy or by temperature alone: tensor-parallel
    # ranks may sample their own vocabulary shards (sampling/sharded.py).
    shardable: bool
    # The next step may be planned and launched before this one's samples reach the host:
    # they stay on the device (no host path) and the step does not speculate (the next step's
    # drafts are proposed from its tokens). A grammar's next mask needs them on the host, but
    # only the next step's sampler waits for it (Sampler.sample), not its forward pass.
    run_ahead: bool
    constrained: bool  # some row has a grammar's mask
    penalties: bool
    early: bool  # some row has its stop tokens masked (min_tokens)
    logprob_widths: list[int | None]
    # The step runs in speculation mode (ScheduledBatch.speculating): drafts may be proposed
    # from its samples, so they must reach the host first.
    speculating: bool = False

    @classmethod
    def of(cls, seqs: list[Sequence], speculating: bool = False) -> StepRows:
        host = penalties = early = filtered = constrained = False
        widths = []
        for seq in seqs:
            row = seq.row
            host = host or on_host(seq)
            constrained = constrained or row.constrained
            penalties = penalties or row.penalties
            early = early or (row.min_tokens > 0 and is_early(seq))
            filtered = filtered or row.top_k or row.top_p or row.min_p
            widths.append(row.logprobs)
        logprobs = any(w is not None for w in widths)
        graph_safe = bool(seqs) and not (host or penalties or early or logprobs)
        return cls(
            host=host,
            graph_safe=graph_safe,
            shardable=graph_safe and not (filtered or constrained),
            run_ahead=not (host or speculating),
            constrained=constrained,
            penalties=penalties,
            early=early,
            logprob_widths=widths,
            speculating=speculating,
        )


def sample_seed(seed: int, index: int) -> int:
    """The random stream of sample `index` of a request seeded with `seed`, as a signed int64.

    Sample 0 uses the seed itself (as n = 1 does); the others a hash of (seed, index), so the
    samples differ from each other and each is reproducible whatever else is in the batch.
    """
    if index:
        seed = xxhash.xxh64_intdigest(f"{seed}:{index}".encode())
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def row_stream(seq: Sequence, index: int | None = None) -> int:
    """The seed of seq's random stream (of sample `index` for a parent about to fork)."""
    return sample_seed(seq.seed, seq.index if index is None else index)
