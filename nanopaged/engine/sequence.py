"""A sequence (its tokens, where its KV lives, how far it has been computed) and the group of
sequences one request runs as."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanopaged.sampling.rows import classify
from nanopaged.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from nanopaged.engine.detokenizer import ByteTail, IncrementalDetokenizer
    from nanopaged.outputs import LogprobRows


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()  # its KV lives in the CPU swap pool; block_table holds CPU block ids
    FINISHED = enum.auto()


_seq_ids = itertools.count()


class Sequence:
    """Prompt plus generated tokens, with its block table and compute progress."""

    def __init__(
        self, token_ids: list[int], sampling_params: SamplingParams, request_id: str = ""
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        # What its rows need from the sampler, decided once (a beam's: SequenceGroup).
        self.row = classify(sampling_params)
        # Structured outputs: its place in its grammar (structured.GrammarMatcher) once the
        # grammar compiled, and how many output tokens the matcher has taken.
        self.matcher = None
        self.num_matched = 0
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        # Tokens whose KV is in the cache (computed now or found in the prefix cache).
        self.num_computed_tokens = 0
        # Prompt tokens served by the prefix cache at the first schedule.
        self.num_cached_tokens = 0
        # Chained hashes of this sequence's full blocks, in order (prefix caching).
        self.block_hashes: list[int] = []
        # Leading blocks of block_table already offered to the prefix cache.
        self.num_registered_blocks = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # The request this sequence belongs to, and its place among the request's outputs.
        self.group: SequenceGroup | None = None
        self.index = 0
        # The request's seed (its own, or one the LLM drew): sample `index` draws its tokens
        # from the stream of (seed, index), keyed by output position.
        self.seed = 0
        # Sum of the sampled tokens' logprobs, and per token where its raw logprobs (top-k,
        # ranks) are kept: (the step's or SampleOutput's rows, its row), read only when an
        # output is (see LazyLogprobs.from_rows).
        self.cumulative_logprob = 0.0
        self.logprobs: list[tuple[LogprobRows, int]] = []
        # With prompt_logprobs: per prompt position 0.., where the raw logprobs of the prompt
        # token it predicts are kept (the scoring step's rows, its row), recorded as its prefill
        # steps commit; once per position, whatever preemption recomputes.
        self.prompt_logprobs: list[tuple[LogprobRows, int]] = []
        # A request's bad_words as token ids (see logits_processors.bad_words_token_ids).
        self.bad_words_token_ids: list[list[int]] = []
        # Set from a step's advance to its commit (Scheduler): this sequence's row in the step's
        # samples, which may still be on the device while the next step is planned
        # (asynchronous scheduling). The token counts in len() and in num_output_tokens, but
        # joins token_ids only once it is known.
        self.pending_row: int | None = None
        # While stop strings are watched for: the output's text so far, or its newest bytes
        # (engine/detokenizer.py).
        self.detokenizer: IncrementalDetokenizer | ByteTail | None = None

    def fork(self) -> Sequence:
        """A copy with a new seq_id sharing nothing mutable; the BlockManager shares the KV."""
        child = Sequence.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.seq_id = next(_seq_ids)
        child.token_ids = list(self.token_ids)
        child.block_table = []
        child.block_hashes = list(self.block_hashes)
        child.logprobs = list(self.logprobs)  # references: the rows themselves are shared
        child.prompt_logprobs = list(self.prompt_logprobs)
        child.detokenizer = None
        child.matcher = None if self.matcher is None else self.matcher.copy()
        return child

    def __len__(self) -> int:
        return len(self.token_ids) + (self.pending_row is not None)

    @property
    def num_output_tokens(self) -> int:
        return len(self) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt positions whose logprobs are asked for are still to be scored."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, len={len(self)}, computed={self.num_computed_tokens}, "
            f"status={self.status.name}, blocks={self.block_table})"
        )


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
        return sum(not s.is_finished for s in self.seqs)

    def add_child(self, child: Sequence) -> None:
        child.group = self
        self.seqs.append(child)

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, seqs={self.seqs})"
