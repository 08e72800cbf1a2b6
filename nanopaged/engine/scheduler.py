"""Continuous batching: which sequences run this step, and how many tokens each."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanopaged.engine.block_manager import BlockManager
from nanopaged.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """The sequences of one step and how many of their tokens to compute now."""

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def samples(self, i: int) -> bool:
        """Whether seq i reaches its last token this step, so it gets a new token sampled."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_scheduled_tokens[i] == len(seq)


class Scheduler:
    """FCFS continuous batching with chunked prefill and preemption by recompute.

    Each step first extends the running sequences (one token for a decode, the next chunk for
    a prefill in progress), then admits waiting ones while the token budget and blocks last.
    When a running sequence cannot get a block, the newest running sequence is preempted: its
    blocks are freed and it waits again at the head of the queue, to be recomputed.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work; may preempt running sequences to make room."""
        bm = self.block_manager
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            while not bm.append_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_scheduled_tokens.append(num_new)
                budget -= num_new
                i += 1
                continue
            break  # seq preempted itself: nothing newer is left to run

        # Admit waiting sequences only when nothing was preempted, or they would thrash.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            cached = bm.get_computed_blocks(seq)
            num_cached_tokens = len(cached) * bm.block_size
            num_new = min(len(seq) - num_cached_tokens, budget)
            if not bm.allocate(seq, cached, num_new):
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_scheduled_tokens.append(num_new)
            budget -= num_new
        return batch

    def postprocess(self, batch: ScheduledBatch, sampled: list[int]) -> list[Sequence]:
        """Advance computed counts, append sampled tokens, finish sequences; returns finished.

        `sampled` holds one token per sequence of the batch that samples, in batch order.
        """
        bm = self.block_manager
        finished: list[Sequence] = []
        tokens = iter(sampled)
        for i, seq in enumerate(batch.seqs):
            samples = batch.samples(i)
            seq.num_computed_tokens += batch.num_scheduled_tokens[i]
            bm.cache_full_blocks(seq)
            if not samples:
                continue
            token = next(tokens)
            seq.token_ids.append(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, *reason)
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> tuple[str, int | None] | None:
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            return "length", None
        return None

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a running sequence now and give its blocks back."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.block_manager.free(seq)
        self.running.remove(seq)

    def abort_all(self) -> list[Sequence]:
        """Drop every queued and running sequence, freeing their blocks."""
        dropped = list(self.running) + list(self.waiting)
        for seq in self.running:
            self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED
        for seq in self.waiting:
            seq.status = SequenceStatus.FINISHED
        self.running.clear()
        self.waiting.clear()
        return dropped
