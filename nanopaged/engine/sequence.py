"""A sequence: its tokens, where its KV lives and how far it has been computed; its group."""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

from nanopaged.sampling.rows import classify
from nanopaged.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanopaged.engine.group import SequenceGroup
    from nanopaged.engine.output_processor import ByteTail, IncrementalDetokenizer
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
        # Set while this sequence's newest token is a sample still on the device (asynchronous
        # scheduling): its row in that step's sampled tokens. The token counts in len() and in
        # num_output_tokens, but joins token_ids only once it is known (Scheduler.commit).
        self.pending_row: int | None = None
        # While stop strings are watched for: the output's text so far, or its newest bytes
        # (engine/output_processor.py).
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
