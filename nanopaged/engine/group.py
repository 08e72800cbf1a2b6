"""A request as the scheduler sees it: the sequences sharing one prompt, handled as a whole."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanopaged.engine.sequence import Sequence, SequenceStatus
from nanopaged.sampling.rows import classify
from nanopaged.sampling_params import BeamSearchParams

if TYPE_CHECKING:
    from nanopaged.outputs import LogprobRows


@dataclass
class BeamHypothesis:
    """A beam set aside as an answer: its generated tokens and their summed logprob."""

    token_ids: list[int]
    cumulative_logprob: float
    # Per token, where its raw logprobs are kept (see Sequence.logprobs).
    logprobs: list[tuple[LogprobRows, int]] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" when it ended with EOS


class SequenceGroup:
    """One request: a single sequence, n parallel samples, or the live beams of a beam search.

    The prompt is prefilled once by `seqs[0]`; its first sampling step forks it into
    `num_samples` sequences that share the prompt's blocks. The scheduler preempts, swaps and
    resumes a group whole, because its sequences share KV blocks.
    """

    def __init__(
        self,
        request_id: str,
        seq: Sequence,
        beam_params: BeamSearchParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = seq.sampling_params
        self.beam_params = beam_params
        self.prompt_len = seq.num_prompt_tokens
        # Samples: every sequence, finished or not, in index order. Beams: the live beams.
        self.seqs: list[Sequence] = [seq]
        seq.group = self
        seq.index = 0
        # How many sequences the first sampled token forks the prompt into.
        p = self.sampling_params
        self.num_samples = 1 if beam_params is not None else (p.best_of or p.n)
        self.forked = self.num_samples == 1
        self.completed_beams: list[BeamHypothesis] = []
        self.beams_done = False
        if beam_params is not None:
            seq.row = classify(self.sampling_params, beam=True)

    def mark_forked(self) -> None:
        """The prompt's first sampling step has forked it into num_samples sequences."""
        self.forked = True

    @property
    def is_beam_search(self) -> bool:
        return self.beam_params is not None

    @property
    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    def seqs_with_status(self, status: SequenceStatus) -> list[Sequence]:
        return [s for s in self.seqs if s.status == status]

    @property
    def is_finished(self) -> bool:
        if self.is_beam_search:
            return self.beams_done
        return all(s.is_finished for s in self.seqs)

    @property
    def max_num_running_seqs(self) -> int:
        """The most sequences this group can have running at once from now on."""
        if self.is_beam_search:
            return self.beam_params.beam_width
        if not self.forked:
            return self.num_samples
        return len(self.unfinished_seqs)

    def add_child(self, child: Sequence) -> None:
        child.group = self
        self.seqs.append(child)

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, seqs={self.seqs})"
