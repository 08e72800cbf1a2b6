"""What the runner hands back per sampled sequence when a plain token id is not enough, the
raw logprobs of a plain step, kept whole for its rows to refer to, and the error a step raises
when NaN or infinite logits decided a row's token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import numpy as np

    from nanopaged.engine.sequence import Sequence
    from nanopaged.outputs import RawLogprobs


class NonFiniteLogitsError(RuntimeError):
    """Logits that were NaN or infinite at run time decided the tokens of some requests: the
    step's samples were dropped rather than appended, and the run's requests ended."""

    def __init__(self, request_ids: list[str], names: list[str] | None = None) -> None:
        """names: how to call the requests in the message (default: 'request <id>')."""
        self.request_ids = request_ids
        if names is None:
            s = "s" if len(request_ids) > 1 else ""
            names = [f"request{s} " + ", ".join(repr(r) for r in request_ids)]
        super().__init__(
            f"the logits of {', '.join(names)} were NaN or "
            "infinite at run time, most likely an overflow in the model's activations "
            "(past float16's or bfloat16's range, or weights that are finite but explode): "
            "try dtype=\"float32\", or check the checkpoint's weights"
        )


def check_finite(finite: torch.Tensor, seqs: list[Sequence] | None) -> None:
    """Raise NonFiniteLogitsError naming the requests of the rows whose flag is False (finite:
    [rows] bool on the host; seqs: each row's sequence, without them rows are named by their
    index). A row of a sequence that finished while its step was in flight is dropped
    unread (Scheduler.postprocess, commit): what it holds is no error."""
    if bool(finite.all()):
        return
    bad = (~finite).nonzero()[:, 0].tolist()
    if seqs is not None:
        bad = [i for i in bad if not seqs[i].is_finished]
    if bad:
        names = [str(i) if seqs is None else seqs[i].request_id for i in bad]
        raise NonFiniteLogitsError(list(dict.fromkeys(names)))  # each request once (n > 1)


@dataclass
class DeviceSamples:
    """A step's tokens sampled on the device, with each row's sampled_logits: the logit its
    token was drawn at, or under tensor-parallel sharding the score it won with (the logit
    over the temperature plus noise; a greedy row's logit). NaN in a row's final hidden state
    makes every logit of the row NaN, and an infinite logit wins the draw, so the value is
    not finite when NaN or infinite logits decided the token: one value a row, checked on
    the host, where a pass over the [rows, vocab] logits would cost a share of the step."""

    token_ids: torch.Tensor  # [rows] int64
    sampled_logits: torch.Tensor  # [rows] float


@dataclass
class SampleOutput:
    """One sequence's logits row turned into tokens.

    token_ids: the sampled token; n tokens for a parent about to fork into n samples; the
    2 * beam_width best candidates for a beam. logprobs: each token's logprob under the model's
    raw distribution. top_logprobs: per token, the row's top-k logprobs plus that token's.
    top_ranks: per token, the 1-based rank of each token of top_logprobs in the raw distribution.
    finite: whether finite logits decided the tokens (see DeviceSamples); the step's reader
    raises NonFiniteLogitsError rather than hand out tokens that are not.
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    top_ranks: list[dict[int, int]] | None = None
    finite: bool = True

    def position(self, j: int) -> RawLogprobs:
        """Token j's raw logprobs as a sequence that took it records them: its top_logprobs
        and top_ranks; a beam candidate (no top_logprobs) alone, ranked by its place among
        the candidates (they come best first)."""
        if self.top_logprobs is not None:
            top = self.top_logprobs[j]
            rank_of = {} if self.top_ranks is None else self.top_ranks[j]
            tokens = list(top)
            return tokens, list(top.values()), [rank_of.get(t) for t in tokens]
        assert self.logprobs is not None, "a token without logprobs has no position"
        return [self.token_ids[j]], [self.logprobs[j]], [j + 1]


class StepLogprobs:
    """A plain step's raw logprobs on the host, shared by all its sampled rows.

    Each sequence records (this, its row) per generated token; a row's dicts are made only when
    an output reads that position (see LazyLogprobs). token_ids and logprobs are the per-row
    lists the step's bookkeeping reads anyway (its tokens, the cumulative logprobs).
    """

    __slots__ = ("token_ids", "logprobs", "top_logprobs", "top_token_ids", "ranks", "widths")

    def __init__(
        self,
        token_ids: list[int],
        logprobs: list[float],
        top_logprobs: np.ndarray,
        top_token_ids: np.ndarray,
        ranks: np.ndarray,
        widths: list[int | None],
    ) -> None:
        """token_ids: the sampled tokens; logprobs: their raw logprobs (Python floats of the
        fp32 values); top_logprobs: [rows, k] fp32 and top_token_ids: [rows, k] int64, each
        row's top-k best first; ranks: [rows] int64, each sampled token's 1-based rank;
        widths: per row, the k it asked for (None: no logprobs)."""
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        self.top_token_ids = top_token_ids
        self.ranks = ranks
        self.widths = widths

    def position(self, row: int) -> RawLogprobs:
        """Row's top-k (its width of them, ranked 1..width) plus its sampled token, which
        keeps its place in the top-k if it is there and takes its own logprob and its rank
        over the whole vocabulary."""
        width = self.widths[row]
        tokens = self.top_token_ids[row].tolist()
        logprobs = self.top_logprobs[row].tolist()
        if width < len(tokens):
            del tokens[width:], logprobs[width:]
        ranks: list[int | None] = list(range(1, len(tokens) + 1))
        token = self.token_ids[row]
        if token in tokens:
            j = tokens.index(token)
            logprobs[j], ranks[j] = self.logprobs[row], self.ranks.item(row)
        else:
            tokens.append(token)
            logprobs.append(self.logprobs[row])
            ranks.append(self.ranks.item(row))
        return tokens, logprobs, ranks
