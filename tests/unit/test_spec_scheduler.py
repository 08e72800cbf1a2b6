"""Scheduler with speculative decoding: drafts fit the token budget and the free blocks (never
preempting), a verified row commits several tokens with stops checked in order, rejected
drafts' blocks go back, and a speculating step never runs ahead."""

from __future__ import annotations

from nanopaged.engine.block_manager import BlockManager
from nanopaged.engine.scheduler import Scheduler
from nanopaged.engine.sequence import Sequence
from nanopaged.sampling.rows import StepRows
from nanopaged.sampling_params import SamplingParams

BS = 4
EOS = 99


class FixedProposer:
    """Proposes the same drafts for every sequence; records what it freed."""

    def __init__(self, drafts: list[int]) -> None:
        self.k = len(drafts)
        self.drafts = drafts
        self.freed: list[int] = []

    def propose(self, seqs_tokens, seq_ids):
        return [list(self.drafts) for _ in seqs_tokens]

    def free(self, seq_id: int) -> None:
        self.freed.append(seq_id)


def _sched(drafts, num_blocks=64, budget=64, limit=None, max_model_len=64):
    bm = BlockManager(num_blocks, BS, True)
    return Scheduler(bm, 8, budget, max_model_len, {EOS}, proposer=FixedProposer(drafts),
                     disable_by_batch_size=limit)  # fmt: skip


def _seq(n, start=0, **params) -> Sequence:
    params.setdefault("max_tokens", 16)
    params.setdefault("temperature", 0)
    return Sequence(list(range(start, start + n)), SamplingParams(**params))


def _decoding(s: Scheduler, *seqs: Sequence) -> None:
    """Run seqs' prefill step (no drafts: prompt rows), leaving them at decode rows."""
    for seq in seqs:
        s.add(seq)
    batch = s.schedule()
    assert batch.draft_token_ids == []
    sampled = [7 for i in range(len(batch)) if batch.sampling[i]]
    s.advance(batch)
    s.commit(batch, sampled)


def test_decode_row_carries_drafts_and_commits_accepted_ones():
    s = _sched([20, 21, 22])
    seq = _seq(6)
    _decoding(s, seq)
    batch = s.schedule()
    assert batch.draft_token_ids == [[20, 21, 22]] and batch.num_scheduled_tokens == [4]
    assert batch.sampling[0] and batch.sampled_drafts() == [[20, 21, 22]]
    # Room for positions 6..9 (the last token and three drafts): three blocks of 4.
    assert len(seq.block_table) == 3
    s.advance(batch)
    assert seq.num_computed_tokens == 7  # the drafts count once accepted
    step = s.commit(batch, [[20, 21, 5]])  # two accepted, then the target's correction
    assert seq.output_token_ids == [7, 20, 21, 5]
    assert seq.num_computed_tokens == 9 == len(seq) - 1
    assert step.grown == [seq] and step.num_new_tokens == {seq.seq_id: 3}
    assert len(seq.block_table) == 3  # 10 tokens: the third block holds tokens 8, 9
    assert (s.spec_stats.num_draft_tokens, s.spec_stats.num_accepted_tokens) == (3, 2)
    # All rejected: the block that held only the rejected drafts' K/V goes back.
    batch = s.schedule()
    assert batch.num_scheduled_tokens == [4] and len(seq.block_table) == 4
    s.advance(batch)
    s.commit(batch, [[8]])
    assert seq.num_computed_tokens == 10 and len(seq) == 11 and len(seq.block_table) == 3
    assert s.block_manager.num_free_blocks == 64 - 3


def test_stop_inside_a_run_drops_the_tokens_after_it():
    s = _sched([20, EOS, 22])
    seq = _seq(6)
    _decoding(s, seq)
    batch = s.schedule()
    s.advance(batch)
    step = s.commit(batch, [[20, EOS, 22, 23]])
    assert seq.output_token_ids == [7, 20, EOS] and seq.finish_reason == "stop"
    assert step.finished == [seq] and seq.block_table == []
    assert s.proposer.freed == [seq.seq_id]
    assert s.block_manager.num_free_blocks == 64


def test_drafts_stop_at_max_tokens_and_max_model_len():
    s = _sched([20, 21, 22, 23])
    seq = _seq(6, max_tokens=3)
    _decoding(s, seq)  # one token out: two to go, so one draft at most
    batch = s.schedule()
    assert batch.draft_token_ids == [[20]]
    s.advance(batch)
    s.commit(batch, [[20, 4]])
    assert seq.output_token_ids == [7, 20, 4] and seq.finish_reason == "length"
    s = _sched([20, 21, 22, 23], max_model_len=10)
    seq = _seq(6, max_tokens=50)
    _decoding(s, seq)  # 7 tokens: 3 more fit max_model_len
    assert s.schedule().draft_token_ids == [[20, 21]]


def test_drafts_fit_budget_and_free_blocks_without_preempting():
    # Budget: two decode rows take 2 of 8 tokens; the first row's drafts get the other 6.
    s = _sched([20, 21, 22, 23, 24, 25, 26], budget=8)
    a, b = _seq(4), _seq(4, start=30)
    _decoding(s, a, b)
    batch = s.schedule()
    # One-token rows come first (decodes_first), the drafts moving with their rows.
    assert batch.seqs == [b, a] and batch.draft_token_ids == [[], [20, 21, 22, 23, 24, 25]]
    assert batch.total_tokens == 8
    # Blocks: 2 sequences of 5 tokens hold 2 blocks each, with room for 3 more tokens in
    # the second; with 5 blocks in all, one is free: the first row's drafts take it (7
    # drafts: positions 5..11), the second's fit its own block (3), none is preempted.
    s = _sched([20, 21, 22, 23, 24, 25, 26], num_blocks=5)
    a, b = _seq(4), _seq(4, start=30)
    _decoding(s, a, b)
    batch = s.schedule()
    assert batch.seqs == [a, b]
    assert batch.draft_token_ids == [[20, 21, 22, 23, 24, 25, 26], [20, 21, 22]]
    assert s.block_manager.num_free_blocks == 0 and s.num_preemptions == 0


def test_no_drafts_above_disable_by_batch_size_and_while_early():
    s = _sched([20, 21], limit=1)
    a, b = _seq(4), _seq(4, start=30)
    _decoding(s, a, b)
    batch = s.schedule()
    assert not batch.speculating and batch.draft_token_ids == []
    assert StepRows.of(batch.seqs, batch.speculating).run_ahead
    s = _sched([20, 21])
    seq = _seq(4, min_tokens=3)
    _decoding(s, seq)  # one token out, stop tokens masked at the next: no drafts yet
    batch = s.schedule()
    assert batch.speculating and batch.draft_token_ids == []


def test_speculating_step_never_runs_ahead():
    seq = _seq(4)
    assert StepRows.of([seq]).run_ahead
    assert not StepRows.of([seq], speculating=True).run_ahead
    assert seq.row.may_speculate
    assert not _seq(4, logprobs=1).row.may_speculate


def test_spec_stats_since_and_lengths():
    s = _sched([20, 21, 22])
    seq = _seq(6)
    _decoding(s, seq)
    before = s.spec_stats.copy()
    batch = s.schedule()
    s.advance(batch)
    s.commit(batch, [[20, 21, 22, 9]])  # all three accepted, and a bonus token
    new = s.spec_stats.since(before)
    assert (new.num_verify_rows, new.num_draft_tokens, new.num_accepted_tokens) == (1, 3, 3)
    assert new.acceptance_rate == 1.0 and new.mean_accepted_length == 4.0
    assert before.num_draft_tokens == 0 and "100.0% accepted" in new.describe()


def _step(s: Scheduler, *sampled) -> tuple[bool, list[list[int]]]:
    """Schedule, advance and commit one step; (speculating, its drafts)."""
    batch = s.schedule()
    speculating, drafts = batch.speculating, batch.draft_token_ids
    assert StepRows.of(batch.seqs, speculating).run_ahead == (not speculating)
    s.advance(batch)
    s.commit(batch, list(sampled))
    return speculating, drafts


def test_a_row_that_finds_no_draft_waits_and_its_steps_run_ahead():
    """Misses in a row: waits of 1, 3, then 7 steps (MAX_WAIT); the step before a row
    proposes again is synchronous, the others run ahead."""
    s = _sched([])
    seq = _seq(6, max_tokens=40)
    _decoding(s, seq)
    flags = [_step(s, 5)[0] for _ in range(15)]
    t, f = True, False
    assert flags == [t, t, t, f, f, t, t, f, f, f, f, f, f, t, t]
    assert s.spec_stats.num_draft_tokens == 0


class ScriptedProposer(FixedProposer):
    """Proposes, call after call, the next of its scripted proposals."""

    def __init__(self, *proposals: list[int]) -> None:
        super().__init__(max(proposals, key=len))
        self.script = list(proposals)

    def propose(self, seqs_tokens, seq_ids):
        return [self.script.pop(0) for _ in seqs_tokens]


def test_found_drafts_end_the_wait_rejected_ones_do_not_start_one_and_leaving_forgets():
    s = _sched([])
    s.proposer = ScriptedProposer([], [20, 21], [20, 21], [], [20, 21])
    seq = _seq(6, max_tokens=40)
    _decoding(s, seq)
    assert _step(s, 5) == (True, [])  # found nothing: wait a step
    assert _step(s, 5) == (True, [])  # waits; synchronous, as the row proposes next
    assert _step(s, [5]) == (True, [[20, 21]])  # found: no wait, though both were rejected
    assert _step(s, [20, 5]) == (True, [[20, 21]])
    assert _step(s, 5) == (True, [])  # one miss after finding: a one-step wait again
    assert _step(s, 5) == (True, [])
    assert _step(s, [5]) == (True, [[20, 21]]) and s.proposer.script == []
    s.pacing.record(seq.seq_id, False)
    s.finish(seq, "abort")
    assert s.pacing.step(seq.seq_id) == (True, True)  # no record left
