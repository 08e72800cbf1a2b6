"""Scheduler: chunked prefill, admission limits, preemption order, stop conditions."""

from __future__ import annotations

from nanopaged.engine.block_manager import BlockManager
from nanopaged.engine.scheduler import Scheduler
from nanopaged.engine.sequence import Sequence, SequenceStatus
from nanopaged.sampling_params import SamplingParams

BS = 4
EOS = 99


def _sched(num_blocks=64, max_num_seqs=8, budget=16, max_model_len=64, caching=True):
    bm = BlockManager(num_blocks, BS, caching)
    return Scheduler(bm, max_num_seqs, budget, max_model_len, {EOS})


def _seq(n, start=0, **params) -> Sequence:
    params.setdefault("max_tokens", 8)
    return Sequence(list(range(start, start + n)), SamplingParams(**params))


def _step(s: Scheduler, token: int = 1):
    batch = s.schedule()
    sampled = [token for i in range(len(batch)) if batch.sampling[i]]
    s.advance(batch)
    s.commit(batch, sampled)
    return batch


def test_chunked_prefill_respects_budget():
    s = _sched(budget=16)
    a, b = _seq(20), _seq(10, start=100)
    s.add(a)
    s.add(b)
    batch = _step(s)
    assert batch.seqs == [a] and batch.num_scheduled_tokens == [16]
    assert a.num_output_tokens == 0  # mid-prefill: nothing sampled
    batch = _step(s)
    assert batch.seqs == [a, b] and batch.num_scheduled_tokens == [4, 10]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    batch = _step(s)
    assert batch.num_scheduled_tokens == [1, 1]  # both decoding


def test_max_num_seqs_bounds_running():
    s = _sched(max_num_seqs=2, budget=100)
    seqs = [_seq(3, start=10 * i) for i in range(3)]
    for q in seqs:
        s.add(q)
    batch = _step(s)
    assert batch.seqs == seqs[:2]
    assert [g.seqs for g in s.waiting] == [[seqs[2]]]


def test_newest_running_sequence_is_preempted():
    # 5 blocks of 4: a and b (8 tokens each) take 4; decoding needs 1 more block each.
    s = _sched(num_blocks=5, budget=100, max_model_len=20)
    a, b = _seq(8, max_tokens=8), _seq(8, start=50, max_tokens=8)
    s.add(a)
    s.add(b)
    _step(s)  # prefill both: 4 blocks; each sampled one token (9 tokens, 8 computed)
    batch = _step(s)  # a gets the last free block; b has none left: b (newest) is preempted
    assert batch.seqs == [a]
    assert b.status == SequenceStatus.WAITING and [g.seqs for g in s.waiting] == [[b]]
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert s.num_preemptions == 1
    while s.has_unfinished():
        _step(s)
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert s.block_manager.num_free_blocks == 5


def test_fully_cached_prompt_still_computes_a_token():
    s = _sched(budget=100)
    a = _seq(8, max_tokens=1)
    s.add(a)
    _step(s)
    assert a.is_finished
    b = _seq(8, max_tokens=1)
    s.add(b)
    batch = _step(s)
    assert b.num_cached_tokens == 4  # first block only; the last block is recomputed
    assert batch.num_scheduled_tokens == [4]
    assert b.is_finished and b.num_output_tokens == 1


def test_stop_conditions():
    s = _sched(budget=100)
    eos = _seq(3)
    ignore = _seq(3, start=10, ignore_eos=True, max_tokens=2)
    min_tok = _seq(3, start=20, min_tokens=2)
    stop_id = _seq(3, start=30, stop_token_ids=[EOS + 1])
    for q in (eos, ignore, min_tok, stop_id):
        s.add(q)
    batch = s.schedule()
    s.advance(batch)
    s.commit(batch, [EOS, EOS, EOS, EOS + 1])
    assert eos.finish_reason == "stop" and eos.stop_reason is None
    assert stop_id.finish_reason == "stop" and stop_id.stop_reason == EOS + 1
    assert not ignore.is_finished and not min_tok.is_finished
    batch = s.schedule()
    s.advance(batch)
    s.commit(batch, [EOS, EOS])
    assert ignore.finish_reason == "length" and ignore.output_token_ids == [EOS, EOS]
    assert min_tok.finish_reason == "stop"
    assert not s.has_unfinished()


def test_max_model_len_ends_sequence():
    s = _sched(budget=100, max_model_len=6)
    q = _seq(4, max_tokens=50)
    s.add(q)
    while s.has_unfinished():
        _step(s)
    assert len(q) == 6 and q.finish_reason == "length"


def test_abort_all_frees_everything():
    s = _sched(budget=6)
    for i in range(3):
        s.add(_seq(5, start=10 * i))
    _step(s)
    dropped = s.abort_all()
    assert len(dropped) == 3 and not s.has_unfinished()
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_mixed_step_lists_decodes_first():
    # A running chunk takes the rest of the budget, so later rows are new prompts: a step's
    # decode rows already come first (the GPU splits them off into the decode kernel).
    s = _sched(budget=20)
    a, b, c = _seq(3), _seq(30, start=100), _seq(2, start=200)
    s.add(a)
    s.add(b)
    s.add(c)
    batch = _step(s, token=7)  # a (3) and b's first 17 tokens; c waits for budget
    assert batch.seqs == [a, b] and batch.num_scheduled_tokens == [3, 17]
    d = _seq(5, start=300)
    s.add(d)
    batch = _step(s, token=8)  # a decodes, b's last 13, then c (2) and d's first 4
    assert batch.seqs == [a, b, c, d] and batch.num_scheduled_tokens == [1, 13, 2, 4]
    batch = _step(s, token=9)  # a, b, c decode; d's last token is a one-token chunk
    assert batch.seqs == [a, b, c, d] and batch.num_scheduled_tokens == [1, 1, 1, 1]
    e = _seq(6, start=400)
    s.add(e)
    batch = _step(s, token=5)
    assert batch.seqs == [a, b, c, d, e] and batch.num_scheduled_tokens == [1, 1, 1, 1, 6]


def test_decodes_first_moves_only_what_it_must():
    from nanopaged.engine.scheduler import ScheduledBatch, decodes_first

    seqs = [_seq(2, start=10 * i) for i in range(4)]
    for counts in ([1, 1, 5, 3], [5, 3, 2, 4], [1, 1, 1, 1]):
        batch = ScheduledBatch(seqs=list(seqs), num_scheduled_tokens=list(counts))
        decodes_first(batch)
        assert batch.seqs == seqs and batch.num_scheduled_tokens == counts
    batch = ScheduledBatch(seqs=list(seqs), num_scheduled_tokens=[4, 1, 7, 1])
    decodes_first(batch)
    assert batch.seqs == [seqs[1], seqs[3], seqs[0], seqs[2]]
    assert batch.num_scheduled_tokens == [1, 1, 4, 7]
