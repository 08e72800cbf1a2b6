"""What a step's sampling hands back: a StepHandle over its samples (bare token ids on the
device, or a SampleOutput per sequence when a plain token id is not enough), the raw logprobs
of a plain step, kept whole for its rows to refer to, and the error a step raises when NaN or
infinite logits decided a row's token."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nanopaged.platform import HostCopy

if TYPE_CHECKING:
    import numpy as np

    from nanopaged.engine.sequence import Sequence
    from nanopaged.outputs import RawLogprobs
    from nanopaged.sampling.prompt_logprobs import PromptLogprobRows, PromptScores


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
class GraphSampler:
    """A decode graph's masked sampler (DecodeGraphs.run), its forward pass queued: replay()
    queues the sampler once the rows' masks are in `words` (mask rows) and `rows` (each row's
    mask, -1: none), the graph's own buffers."""

    words: torch.Tensor  # [capacity, ceil(vocab / 32)] int32
    rows: torch.Tensor  # [rows] int32
    replay: Callable[[], DeviceSamples]


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


class StepHandle:
    """A launched step's samples: on the device, copying to the host, or already there.

    A plain step's raw logprobs (for the rows that asked for them) come back the same way, in
    the same asynchronous copy as its tokens; so do the prompt logprobs of the prompt rows it
    scored (prompt), and each row's sampled logit, which result() checks before it hands out a
    token (NonFiniteLogitsError).

    A step with structured outputs' rows is launched with its sampler deferred (deferred): its
    forward pass is queued, and its sampler waits until the engine has advanced the rows'
    matchers through the previous step's tokens (sampled()).
    """

    def __init__(self, outputs: list | None = None) -> None:
        self.outputs = outputs
        self.prompt: PromptScores | None = None
        self.tokens: torch.Tensor | None = None  # [num_sampled] int64 on the device
        # The sequence of each sampled row: names the requests of rows that fail the check.
        self.seqs: list[Sequence] | None = None
        self._copy: HostCopy | None = None
        self._has_logits = False
        # [num_sampled] bool on the host, whether finite logits decided each row's token
        # (None: not known yet, or checked and all finite).
        self._finite: torch.Tensor | None = None
        self._logprob_widths: list[int | None] | None = None
        self._logprobs: StepLogprobs | None = None
        # Whether the next step may be launched before these samples reach the host (set by
        # the Sampler from the step's rows: StepRows.run_ahead).
        self.run_ahead = False
        # A deferred sampler (see deferred) until sampled() runs it; then the handle it made.
        self._sampler: Callable[[], StepHandle] | None = None
        self._sampled: StepHandle | None = None

    @classmethod
    def deferred(cls, sampler: Callable[[], StepHandle]) -> StepHandle:
        """A launched step whose forward pass is queued and whose sampler waits: sampler()
        fills the rows' masks from their matchers, queues the sampling and returns the
        samples' handle (see sampled)."""
        handle = cls()
        handle._sampler = sampler
        return handle

    def sampled(self) -> StepHandle:
        """The handle of the step's samples: this one, or for a deferred sampler the one it
        returns, run at the first call (the engine calls it once every sequence's matcher
        took the tokens of the steps before)."""
        if self._sampler is not None:
            self._sampled, self._sampler = self._sampler(), None
            self._sampled.prompt = self.prompt
        return self if self._sampled is None else self._sampled

    @classmethod
    def copy_to_host(
        cls,
        tokens: torch.Tensor,
        logprobs: tuple[torch.Tensor, ...] | None = None,
        widths: list[int | None] | None = None,
        sampled_logits: torch.Tensor | None = None,
    ) -> StepHandle:
        """tokens: [rows]; logprobs: (sampled [rows], top values [rows, k], top ids [rows, k],
        sampled token's rank [rows]); widths: per row, the top-k it asked for (None: none);
        sampled_logits: [rows], see DeviceSamples (None: nothing to check)."""
        handle = cls()
        handle.tokens = tokens
        handle._logprob_widths = widths
        tensors = [tokens, *(logprobs or ())]
        if sampled_logits is not None:
            tensors.append(sampled_logits)
            handle._has_logits = True
        handle._copy = HostCopy(tensors)
        return handle

    @classmethod
    def of_outputs(cls, outputs: list[SampleOutput]) -> StepHandle:
        """A step sampled on the host path already: its outputs, checked as the device's
        samples are (SampleOutput.finite)."""
        handle = cls(outputs)
        handle._finite = torch.tensor([out.finite for out in outputs], dtype=torch.bool)
        return handle

    @property
    def plain(self) -> bool:
        """Bare token ids (not SampleOutputs), kept on the device for the next step."""
        return self.tokens is not None

    def result(self) -> list[int] | list[SampleOutput]:
        """The samples, waiting for the device if needed. Raises NonFiniteLogitsError, at
        every call, when NaN or infinite logits decided the token of a row that is to be
        appended (read only now: a sequence that finished meanwhile drops its row)."""
        assert self._sampler is None and self._sampled is None, "read the samples' handle"
        if self.outputs is None:
            host = self._copy.result()
            if self._has_logits:
                self._finite = torch.isfinite(host[-1])
            self.outputs = host[0].tolist()
        if self._finite is not None:
            check_finite(self._finite, self.seqs)
            self._finite = None
        return self.outputs

    def logprobs(self) -> StepLogprobs | None:
        """The raw logprobs of a plain step's sampled rows, kept whole as host arrays for the
        rows to refer to; None when no row asked for them."""
        if self._logprob_widths is None:
            return None
        if self._logprobs is None:
            tokens = self.result()
            picked, top_v, top_i, ranks = self._copy.result()[1:5]
            # Copies: pinned buffers go back to their pool; a CPU step's may be views of more.
            self._logprobs = StepLogprobs(
                tokens,
                picked.tolist(),
                top_v.numpy().copy(),
                top_i.numpy().copy(),
                ranks.numpy().copy(),
                self._logprob_widths,
            )
        return self._logprobs

    def prompt_logprobs(self) -> PromptLogprobRows | None:
        """The prompt logprobs of the step's prompt rows on the host, in the order of its
        ScheduledBatch.prompt_logprob_spans; None when it scored none."""
        return None if self.prompt is None else self.prompt.rows()
