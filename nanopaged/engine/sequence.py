"""A sequence: its tokens, where its KV lives and how far it has been computed."""

from __future__ import annotations

import enum
import itertools

from nanopaged.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
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

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, len={len(self)}, computed={self.num_computed_tokens}, "
            f"status={self.status.name}, blocks={self.block_table})"
        )
