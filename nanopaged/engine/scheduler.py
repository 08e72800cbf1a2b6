"""Continuous batching: which sequences run this step, and how many tokens each."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from nanopaged.config import PREEMPTION_MODES
from nanopaged.engine.beam import beam_search_step, finalize_beams
from nanopaged.engine.block_manager import BlockManager
from nanopaged.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from nanopaged.sampling.output import SampleOutput, StepLogprobs
from nanopaged.sampling.rows import is_early, on_host
from nanopaged.spec.pacing import DraftPacing
from nanopaged.spec.stats import SpecStats

if TYPE_CHECKING:
    from nanopaged.sampling.prompt_logprobs import PromptLogprobRows


@dataclass
class ScheduledBatch:
    """The sequences of one step, how many of their tokens to compute now, and the block moves
    (swap out, swap in, copy-on-write) the runner makes before the forward pass, in that order.

    prompt_logprob_spans: (i, first, end) for each sequence i of the step that scores prompt
    positions first..end-1 now (their logits rows predict prompt tokens first+1..end), for
    prompt_logprobs; see prompt_logprob_spans.

    Speculative decoding: speculating says the step runs in speculation mode (its samples must
    reach the host before the next step's drafts are proposed); draft_token_ids, when not
    empty, holds each sequence's drafts (d tokens, often none), computed after its last token
    in the same row: its num_scheduled_tokens counts them (1 + d).
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst)
    prompt_logprob_spans: list[tuple[int, int, int]] = field(default_factory=list)
    speculating: bool = False
    draft_token_ids: list[list[int]] = field(default_factory=list)
    # Per row, whether seq i reaches its last token this step, so it gets a new token sampled
    # (reaches_last; set once the step is planned, before it is advanced).
    sampling: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def reaches_last(self, i: int) -> bool:
        """Whether seq i's scheduled tokens reach its last one (before the step is advanced)."""
        seq = self.seqs[i]
        n = self.num_scheduled_tokens[i] - self.num_drafts(i)
        return seq.num_computed_tokens + n == len(seq)

    def sampled_drafts(self) -> list[list[int]]:
        """The drafts of each sequence that samples, in row order."""
        return [d for d, x in zip(self.draft_token_ids, self.sampling) if x]

    def num_drafts(self, i: int) -> int:
        """Draft tokens that seq i's row carries after its last token."""
        return len(self.draft_token_ids[i]) if self.draft_token_ids else 0

    def one_token_rows(self) -> bool:
        """Whether every row computes one token, with the drafts it carries (no prefill chunk
        of more than one token)."""
        counts = self.num_scheduled_tokens
        return all(n == 1 + self.num_drafts(i) for i, n in enumerate(counts))


def prompt_logprob_spans(batch: ScheduledBatch) -> list[tuple[int, int, int]]:
    """(i, first, end) for each sequence i that scores prompt positions first..end-1 in this
    step: its scheduled positions whose next token is a prompt token and whose logprobs no
    step recorded before (a recomputed prefill scores only what its first pass did not; a
    step planned before its predecessor's samples cannot hold prompt positions of a sequence
    that predecessor scored, whose computed tokens are past them)."""
    spans = []
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_scheduled_tokens)):
        if not seq.wants_prompt_logprobs:
            continue
        start = seq.num_computed_tokens
        first = max(start, len(seq.prompt_logprobs))
        end = min(start + n, seq.num_prompt_tokens - 1)
        if first < end:
            assert len(seq.prompt_logprobs) >= start, "no prompt position goes unscored"
            spans.append((i, first, end))
    return spans


def decodes_first(batch: ScheduledBatch) -> None:
    """Reorder a step that mixes decodes with prefill chunks so its one-token rows come first
    (stable on each side): the GPU runs them through the decode kernel as one slice. Every
    later use of the step goes by this order (its sequences, samples and outputs)."""
    counts = batch.num_scheduled_tokens
    order = [i for i, n in enumerate(counts) if n == 1]
    if not order or len(order) == len(counts) or order[-1] == len(order) - 1:
        return  # nothing to move: no decode row, no prefill row, or decodes already first
    order += [i for i, n in enumerate(counts) if n != 1]
    batch.seqs = [batch.seqs[i] for i in order]
    batch.num_scheduled_tokens = [counts[i] for i in order]
    if batch.draft_token_ids:
        batch.draft_token_ids = [batch.draft_token_ids[i] for i in order]


@dataclass
class StepOutput:
    """What a commit changed: sequences that got tokens, and those that finished."""

    grown: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    finished_groups: list[SequenceGroup] = field(default_factory=list)
    # seq_id -> tokens a speculating row appended, where more than one (stop strings are then
    # placed at the first token that completes one).
    num_new_tokens: dict[int, int] = field(default_factory=dict)


class Proposer(Protocol):
    """Drafts for speculative decoding (nanopaged.spec): up to k next tokens per sequence."""

    k: int

    def propose(self, seqs_tokens: list[list[int]], seq_ids: list[int]) -> list[list[int]]: ...
    def free(self, seq_id: int) -> None: ...
    def free_all(self) -> None: ...


class Scheduler:
    """FCFS continuous batching of sequence groups, chunked prefill, preemption of whole groups.

    Each step first extends the running groups (one token per decoding sequence, the next chunk
    of a prefill in progress), then brings back swapped-out groups, then admits waiting ones,
    while the token budget and blocks last. When a running group cannot get blocks, the newest
    running group is preempted whole, because its sequences share blocks: by recompute (blocks
    freed, it waits again at the head of the queue) or by swap (blocks moved to the CPU pool;
    recompute when the pool is full).
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        preemption_mode: str = "recompute",
        proposer: Proposer | None = None,
        disable_by_batch_size: int | None = None,
    ) -> None:
        """proposer: speculative decoding's drafts (None: no speculation), proposed in steps
        with at most disable_by_batch_size running sequences (None: in every step)."""
        assert preemption_mode in PREEMPTION_MODES, preemption_mode
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.preemption_mode = preemption_mode
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_advanced_steps = 0  # steps planned before their predecessor's samples
        # The step advanced and not yet committed, if any (see advance).
        self._advanced: ScheduledBatch | None = None
        self.num_steps = 0  # steps scheduled with work in them
        self.proposer = proposer
        self.pacing = DraftPacing()
        self.disable_by_batch_size = disable_by_batch_size
        self.spec_stats = SpecStats()

    def add(self, item: Sequence | SequenceGroup) -> SequenceGroup:
        """Queue a request; a bare Sequence becomes a group of one."""
        group = item if isinstance(item, SequenceGroup) else SequenceGroup(item.request_id, item)
        for seq in group.seqs:
            seq.status = SequenceStatus.WAITING
        self.waiting.append(group)
        return group

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running_seqs(self) -> int:
        return sum(g.max_num_running_seqs for g in self.running)

    def _has_room(self, group: SequenceGroup) -> bool:
        # An empty engine takes any group, so a request larger than max_num_seqs still runs.
        return (
            not self.running
            or self.num_running_seqs + group.max_num_running_seqs <= self.max_num_seqs
        )

    @staticmethod
    def _plan(remaining: list[int], budget: int) -> list[int]:
        """Tokens to compute now for sequences with `remaining` uncomputed tokens each.

        Sequences of one group reach their last token, and sample, in the same step: when the
        budget cannot finish all of them, each is advanced to at most its next-to-last token.
        """
        if sum(remaining) <= budget:
            return list(remaining)
        if len(remaining) == 1:
            return [budget]
        plan = []
        for r in remaining:
            n = min(r - 1, budget)
            plan.append(n)
            budget -= n
        return plan

    def _preempt(self, group: SequenceGroup, batch: ScheduledBatch) -> None:
        bm = self.block_manager
        seqs = group.seqs_with_status(SequenceStatus.RUNNING)
        self.num_preemptions += 1
        if self.proposer is not None:
            # A draft model's K/V goes with the target's and is recomputed when it is.
            for seq in seqs:
                self._forget_drafts(seq)
        if self.preemption_mode == "swap" and bm.can_swap_out(seqs):
            batch.blocks_to_swap_out.extend(bm.swap_out(seqs))
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            self.num_swap_outs += 1
            self.swapped.appendleft(group)
            return
        for seq in seqs:
            bm.free(seq)
            _reset_for_recompute(seq)
        self.waiting.appendleft(group)

    def _drop_swapped(self, group: SequenceGroup) -> None:
        """Give a swapped-out group's CPU blocks back; it will be recomputed from scratch."""
        for seq in group.seqs_with_status(SequenceStatus.SWAPPED):
            for cpu_id in seq.block_table:
                self.block_manager.cpu_pool.decref(cpu_id)
            seq.block_table = []
            _reset_for_recompute(seq)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work; may preempt running groups to make room."""
        batch = ScheduledBatch()
        budget, preempted = self._schedule_running(batch, self.max_num_batched_tokens)
        budget = self._schedule_swapped(batch, budget, preempted)
        if not preempted or not batch.seqs:
            self._schedule_waiting(batch, budget)
        if self.proposer is not None and batch.seqs:
            self._propose(batch)
        self.num_advanced_steps += self._advanced is not None
        self.num_steps += bool(batch.seqs)
        if batch.total_tokens != len(batch.seqs):
            decodes_first(batch)
        batch.sampling = [batch.reaches_last(i) for i in range(len(batch.seqs))]
        batch.prompt_logprob_spans = prompt_logprob_spans(batch)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> tuple[int, bool]:
        """Extend the running groups within budget, preempting the newest when blocks run out;
        returns (the budget left, whether any group was preempted)."""
        bm = self.block_manager
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            group = self.running[i]
            if len(group.seqs) == 1:  # the common case, kept cheap: one running sequence
                seq = group.seqs[0]
                n = min(len(seq) - seq.num_computed_tokens, budget)
                if bm.append_slots(seq, n, batch.blocks_to_copy):
                    batch.seqs.append(seq)
                    batch.num_scheduled_tokens.append(n)
                    budget -= n
                    i += 1
                    continue
                work = [(seq, n)]
            else:
                seqs = group.seqs_with_status(SequenceStatus.RUNNING)
                counts = self._plan([len(s) - s.num_computed_tokens for s in seqs], budget)
                work = [(s, n) for s, n in zip(seqs, counts) if n > 0]
                if not work:
                    break
            while bm.blocks_needed(work) > bm.num_free_blocks:
                victim = self.running.pop()
                self._preempt(victim, batch)
                preempted = True
                if victim is group:
                    break
            else:
                for seq, n in work:
                    ok = bm.append_slots(seq, n, batch.blocks_to_copy)
                    assert ok, "blocks_needed counted the blocks this append takes"
                    batch.seqs.append(seq)
                    batch.num_scheduled_tokens.append(n)
                    budget -= n
                i += 1
                continue
            break  # the group preempted itself: nothing newer is left to run
        return budget, preempted

    def _schedule_swapped(self, batch: ScheduledBatch, budget: int, preempted: bool) -> int:
        """Bring swapped-out groups back within budget; returns the budget left. They come back
        before new ones are admitted, and only when nothing was preempted this step (or they
        would thrash), unless nothing runs at all."""
        bm = self.block_manager
        while (not preempted or not batch.seqs) and self.swapped and budget > 0:
            group = self.swapped[0]
            if not self._has_room(group):
                break
            seqs = group.seqs_with_status(SequenceStatus.SWAPPED)
            counts = self._plan([len(s) - s.num_computed_tokens for s in seqs], budget)
            if sum(counts) == 0:
                break
            if bm.blocks_to_swap_in(list(zip(seqs, counts))) > bm.num_free_blocks:
                if self.running:
                    break  # running groups will finish and give blocks back
                # Nothing runs and the free pool is all there is: recompute it instead, from
                # the head of the queue (a group always fits an empty pool, see LLM).
                self.swapped.popleft()
                self._drop_swapped(group)
                self.waiting.appendleft(group)
                continue
            self.swapped.popleft()
            batch.blocks_to_swap_in.extend(bm.swap_in(seqs))
            self.running.append(group)
            for seq, n in zip(seqs, counts):
                seq.status = SequenceStatus.RUNNING
                if n > 0:
                    ok = bm.append_slots(seq, n, batch.blocks_to_copy)
                    assert ok, "blocks_to_swap_in counted the blocks this append takes"
                    batch.seqs.append(seq)
                    batch.num_scheduled_tokens.append(n)
                    budget -= n
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        """Admit waiting groups in order while budget, room and blocks last (none while a
        swapped-out group waits to come back)."""
        while not self.swapped and self.waiting and budget > 0:
            group = self.waiting[0]
            if not self._has_room(group):
                break
            num_tokens = self._admit(group, budget, batch)
            if num_tokens is None:
                break
            self.waiting.popleft()
            self.running.append(group)
            budget -= num_tokens

    def _admit(self, group: SequenceGroup, budget: int, batch: ScheduledBatch) -> int | None:
        """Allocate blocks for every waiting sequence of group (all or none) and schedule them;
        returns the tokens scheduled, or None when the group does not fit."""
        bm = self.block_manager
        seqs = group.seqs_with_status(SequenceStatus.WAITING)
        cached = [self._cache_hits(s) for s in seqs]
        remaining = [len(s) - len(c) * bm.block_size for s, c in zip(seqs, cached)]
        counts = self._plan(remaining, budget)
        if sum(counts) == 0:
            return None
        if not bm.allocate_group(seqs, cached, counts):  # the group runs whole or not at all
            return None
        for seq, n in zip(seqs, counts):
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            if n > 0:
                batch.seqs.append(seq)
                batch.num_scheduled_tokens.append(n)
        return sum(counts)

    def _cache_hits(self, seq: Sequence) -> list[int]:
        """seq's prefix-cache hits. A sequence with prompt logprobs still to score computes
        those positions (it needs their logits), so it takes no hit covering one; the blocks
        it computes are published for others all the same."""
        bm = self.block_manager
        hits = bm.get_computed_blocks(seq)
        if seq.wants_prompt_logprobs:
            hits = hits[: len(seq.prompt_logprobs) // bm.block_size]
        return hits

    # ---- speculative decoding: drafts for the decode rows of a step ----------------------
    def _propose(self, batch: ScheduledBatch) -> None:
        """Mark the step speculating when few enough sequences run and a row proposes in it
        or in the next (spec/pacing.py), and give its decode rows the proposer's drafts within
        the token budget left and the free blocks (fewer drafts where they run short: drafts
        never preempt)."""
        limit = self.disable_by_batch_size
        if limit is not None and self.num_running_seqs > limit:
            return
        sampled = [(i, s) for i, s in enumerate(batch.seqs) if batch.reaches_last(i)]
        # A row sampled on the host path (a prompt about to fork into n samples) takes the
        # whole step there: no drafts beside it.
        if any(on_host(s) for _, s in sampled):
            batch.speculating = True
            return
        counts = batch.num_scheduled_tokens
        rows, due = [], False
        for i, seq in sampled:
            if not self._speculates(seq):
                continue
            now, then = self.pacing.step(seq.seq_id)
            if now and self._may_draft(seq, counts[i]):
                rows.append(i)
            else:  # not now (a prompt's last chunk, a token still on the device, min_tokens
                # not reached, or waiting): if it may propose next, this step is synchronous
                due = due or now or then
        if not rows and not due:
            return  # no row proposes in this step or the next: it may run ahead
        batch.speculating = True
        if not rows:
            return
        seqs = [batch.seqs[i] for i in rows]
        proposals = self.proposer.propose([s.token_ids for s in seqs], [s.seq_id for s in seqs])
        budget = self.max_num_batched_tokens - batch.total_tokens
        drafts: list[list[int]] = [[] for _ in batch.seqs]
        for i, seq, proposal in zip(rows, seqs, proposals):
            self.pacing.record(seq.seq_id, bool(proposal))
            d = min(len(proposal), self._draft_room(seq), budget)
            if d <= 0:
                continue
            ok = self.block_manager.append_slots(seq, 1 + d, batch.blocks_to_copy)
            assert ok, "_draft_room counted the free blocks"
            drafts[i] = proposal[:d]
            batch.num_scheduled_tokens[i] += d
            budget -= d
        if any(drafts):
            batch.draft_token_ids = drafts

    @staticmethod
    def _speculates(seq: Sequence) -> bool:
        """Whether seq's decode rows may carry drafts at all: its class samples from plain
        logits, and it is not a prompt about to fork or a beam."""
        group = seq.group
        return seq.row.may_speculate and (
            group is None or (group.forked and not group.is_beam_search)
        )

    def _may_draft(self, seq: Sequence, num_scheduled: int) -> bool:
        """Whether seq's row (one that _speculates) is this step a decode row that may carry
        drafts: its one token to compute is its last, known on the host, and its drafts
        would be verified from plain logits (no stop tokens masked at any of its positions:
        min_tokens is reached)."""
        return (
            num_scheduled == 1
            and seq.pending_row is None
            and seq.num_computed_tokens == len(seq) - 1
            and not is_early(seq)
        )

    def _forget_drafts(self, seq: Sequence) -> None:
        """Drop the proposer's and the pacing's state of a sequence that finished or left."""
        self.proposer.free(seq.seq_id)
        self.pacing.forget(seq.seq_id)

    def _draft_room(self, seq: Sequence) -> int:
        """The most drafts seq's row can carry: the proposer's k, no more than would pass
        max_tokens or max_model_len once all are accepted and one token added, and no more
        than the free blocks hold past the block its last token goes in."""
        bm = self.block_manager
        p = seq.sampling_params
        room = min(
            self.proposer.k,
            p.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - len(seq) - 1,
        )
        slots = (max(len(seq.block_table), bm.num_blocks_for(len(seq))) + bm.num_free_blocks)
        return min(room, slots * bm.block_size - len(seq))

    # ---- a launched step: advance it (the next may then be planned), commit its samples ----
    def can_look_ahead(self, batch: ScheduledBatch) -> bool:
        """Whether the step after `batch` can be scheduled before its samples are known (asked
        before `batch` is advanced).

        Only plain steps qualify: every running sequence is in the batch and samples one token
        (no beam, no parent about to fork), nothing is swapped out, and the free blocks cover
        every sequence's next token, so scheduling it cannot preempt anything. Stop strings are
        checked when the samples arrive; a sequence they stop drops its in-flight token.
        """
        if self.swapped:
            return False
        bm = self.block_manager
        need = live = 0
        for seq, samples in zip(batch.seqs, batch.sampling):
            if seq.is_finished:  # stopped while this step was in flight; its sample is dropped
                continue
            live += 1
            group = seq.group
            if not samples or (
                group is not None and (group.is_beam_search or not group.forked)
            ):
                return False
            need += bm.num_blocks_for(len(seq) + 1) > len(seq.block_table)
        return live == self.num_running_seqs and need <= bm.num_free_blocks

    def advance(self, batch: ScheduledBatch) -> None:
        """Account for a launched step before its samples are read: its computed tokens and
        full blocks, and each sampling sequence's row of the samples (pending_row, whose token
        counts in len() from now on), resolved by `commit`. The next step may be scheduled in
        between (asynchronous scheduling: see can_look_ahead)."""
        assert self._advanced is None, "each advanced step is committed before the next"
        self._advanced = batch
        bm = self.block_manager
        row = 0
        for i, (seq, samples) in enumerate(zip(batch.seqs, batch.sampling)):
            if seq.is_finished:  # ended while this step was in flight: its row is dropped
                row += samples
                continue
            # A row's drafts count as computed only once accepted (commit).
            seq.num_computed_tokens += batch.num_scheduled_tokens[i] - batch.num_drafts(i)
            bm.cache_full_blocks(seq)
            if samples:
                seq.pending_row = row
                row += 1

    def commit(
        self,
        batch: ScheduledBatch,
        sampled: list[int] | list[SampleOutput],
        logprobs: StepLogprobs | None = None,
        prompt_logprobs: PromptLogprobRows | None = None,
    ) -> StepOutput:
        """Record the advanced step's scored prompt positions and give each sequence waiting
        for a sample its token (forking samples and stepping beams); finish sequences that stop.

        `sampled` holds, in row order, a token id or a SampleOutput for each sequence of the
        batch that samples (in a step with drafts, a list of new tokens: see _append_run);
        `logprobs`, beside plain token ids, the rows' raw logprobs;
        `prompt_logprobs`, the step's prompt rows' (its prompt_logprob_spans). A sequence that
        finished while the step was in flight was given no row: its sample is dropped.
        """
        assert batch is self._advanced, "commit takes the step advance was given"
        self._advanced = None
        step = StepOutput()
        _record_prompt_logprobs(batch, prompt_logprobs)  # before a fork copies them
        beam_results: dict[int, list[tuple[Sequence, SampleOutput]]] = {}
        for i, seq in enumerate(batch.seqs):
            row = seq.pending_row
            if row is None or seq.is_finished:
                # Finished since this step was advanced (its grammar ended): its sample is
                # dropped, and its row still counts in len(), as the step launched after this
                # one counted it (advance lines that step's rows up by it).
                continue
            seq.pending_row = None
            out = sampled[row]
            if isinstance(out, list):  # a speculating step's row: 1 .. d + 1 tokens
                self._append_run(seq, out, batch.num_drafts(i), step)
                continue
            if not isinstance(out, SampleOutput):  # a plain token id
                seq.token_ids.append(out)
                if logprobs is not None:
                    _append_logprobs(seq, logprobs, row)
                step.grown.append(seq)
                self._finish_if_stopped(seq, step)
                continue
            group = seq.group
            if group is not None and group.is_beam_search:
                beam_results.setdefault(id(group), []).append((seq, out))
                continue
            grown = [seq]
            if len(out.token_ids) > 1:
                grown = self._fork_samples(seq, out)
            else:
                _append(seq, out, 0)
            for s in grown:
                step.grown.append(s)
                self._finish_if_stopped(s, step)
        for results in beam_results.values():
            self._step_beams(results, step)
        return step

    def _append_run(
        self, seq: Sequence, tokens: list[int], num_drafts: int, step: StepOutput
    ) -> None:
        """Give seq a speculating row's new tokens (its accepted drafts, then the target's
        correction or bonus token), each checked for a stop in order: the tokens after the first
        stop are dropped. The accepted drafts' K/V, computed in the row, is then seq's; the
        blocks that held only rejected drafts' go back."""
        if num_drafts:
            self.spec_stats.add(num_drafts, len(tokens) - 1)
        step.grown.append(seq)
        for j, token in enumerate(tokens):
            seq.token_ids.append(token)
            reason = self._stop_reason(seq, token)
            if reason is not None or j == len(tokens) - 1:
                break
        if j:
            step.num_new_tokens[seq.seq_id] = j + 1
        if reason is not None:
            self._finish(seq, reason, step)
            return
        seq.num_computed_tokens = len(seq) - 1
        bm = self.block_manager
        bm.cache_full_blocks(seq)
        bm.trim(seq, len(seq))

    def _step_beams(
        self, results: list[tuple[Sequence, SampleOutput]], step: StepOutput
    ) -> None:
        """One beam search step of a group from its live beams' samples."""
        group = results[0][0].group
        bm = self.block_manager
        live = beam_search_step(group, results, self.eos_token_ids, bm)
        step.grown.extend(live)
        head = live[0] if live else None
        if (
            head is None
            or head.num_output_tokens >= group.beam_params.max_tokens
            or len(head) >= self.max_model_len
        ):
            step.finished.extend(live)
            finalize_beams(group, bm)
            self.running.remove(group)
            step.finished_groups.append(group)

    def _finish_if_stopped(self, seq: Sequence, step: StepOutput) -> None:
        reason = self._stop_reason(seq, seq.token_ids[-1])
        if reason is not None:
            self._finish(seq, reason, step)

    def _finish(self, seq: Sequence, reason: tuple[str, int | None], step: StepOutput) -> None:
        self.finish(seq, *reason)
        step.finished.append(seq)
        if seq.group is not None and seq.group.is_finished:
            step.finished_groups.append(seq.group)

    def _fork_samples(self, parent: Sequence, out: SampleOutput) -> list[Sequence]:
        """The prompt's first sampling step: parent becomes sample 0, children 1..n-1."""
        group = parent.group
        group.mark_forked()
        children = []
        for j in range(1, len(out.token_ids)):
            child = parent.fork()
            child.index = j
            self.block_manager.fork(parent, child)
            group.add_child(child)
            children.append(child)
        for j, seq in enumerate([parent] + children):
            _append(seq, out, j)
        return [parent] + children

    def _stop_reason(self, seq: Sequence, token: int) -> tuple[str, int | None] | None:
        params = seq.sampling_params
        length = len(seq)
        num_output_tokens = length - seq.num_prompt_tokens
        if num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
        if num_output_tokens >= params.max_tokens or length >= self.max_model_len:
            return "length", None
        return None

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a running sequence now and give its blocks back; its group ends with its last."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.block_manager.free(seq)
        if self.proposer is not None:
            self._forget_drafts(seq)
        group = seq.group
        if group is not None and group.is_finished and group in self.running:
            self.running.remove(group)

    def abort(self, group: SequenceGroup) -> None:
        """Drop one group wherever it is (queued, running or swapped), freeing its blocks; its
        unfinished sequences end with finish_reason "abort"."""
        for seq in group.seqs:
            if seq.status == SequenceStatus.RUNNING:
                self.block_manager.free(seq)
            elif seq.status == SequenceStatus.SWAPPED:
                for cpu_id in seq.block_table:
                    self.block_manager.cpu_pool.decref(cpu_id)
                seq.block_table = []
            if not seq.is_finished:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "abort"
            if self.proposer is not None:
                self._forget_drafts(seq)
        group.beams_done = True
        for queue in (self.running, self.swapped, self.waiting):
            if group in queue:
                queue.remove(group)

    def abort_all(self) -> list[SequenceGroup]:
        """Drop every queued, running and swapped group, freeing their blocks."""
        self._advanced = None
        dropped = list(self.running) + list(self.swapped) + list(self.waiting)
        for group in dropped:
            self.abort(group)
        if self.proposer is not None:
            self.proposer.free_all()  # a sequence a failed step left outside the lists too
            self.pacing.forget_all()
        return dropped


def _reset_for_recompute(seq: Sequence) -> None:
    seq.num_computed_tokens = 0
    seq.num_registered_blocks = 0
    seq.status = SequenceStatus.WAITING
    seq.num_preemptions += 1


def _record_prompt_logprobs(batch: ScheduledBatch, rows: PromptLogprobRows | None) -> None:
    """Give each sequence of the batch's prompt_logprob_spans its positions' rows (kept whole
    and read only when an output is, as a step's logprobs are)."""
    if not batch.prompt_logprob_spans:
        return
    assert rows is not None, "a step with prompt logprob spans scores them"
    at = 0
    for i, first, end in batch.prompt_logprob_spans:
        seq = batch.seqs[i]
        if not seq.is_finished:
            assert len(seq.prompt_logprobs) == first, "each position is recorded once, in order"
            seq.prompt_logprobs.extend((rows, r) for r in range(at, at + end - first))
        at += end - first
    assert at == len(rows)


def _append_logprobs(seq: Sequence, logprobs: StepLogprobs, row: int) -> None:
    """Record row's logprobs for seq's newest token (when it asked for them): the step's
    rows are kept whole and only read when an output is, so this is all a step costs."""
    if logprobs.widths[row] is not None:
        seq.cumulative_logprob += logprobs.logprobs[row]
        seq.logprobs.append((logprobs, row))


def _append(seq: Sequence, out: SampleOutput, j: int) -> None:
    """Give seq token j of out, with its logprobs when they were computed."""
    seq.token_ids.append(out.token_ids[j])
    if out.logprobs is not None:
        seq.cumulative_logprob += out.logprobs[j]
    if out.top_logprobs is not None:
        seq.logprobs.append((out, j))
