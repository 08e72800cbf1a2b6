"""Scheduler with sequence groups: n > 1 forks, copy-on-write pairs, whole-group preemption by
recompute and by swap, beams forking and dying."""

from __future__ import annotations

import itertools

import pytest

from nanopaged.engine.block_manager import BlockManager
from nanopaged.engine.scheduler import Scheduler
from nanopaged.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from nanopaged.sampling.output import SampleOutput
from nanopaged.sampling_params import BeamSearchParams, SamplingParams

BS = 4
EOS = 99


def _sched(num_blocks=64, budget=64, mode="recompute", cpu_blocks=0, max_num_seqs=16):
    bm = BlockManager(num_blocks, BS, True, cpu_blocks)
    return Scheduler(bm, max_num_seqs, budget, 64, {EOS}, mode)


def _group(n_prompt, start=0, beam=None, **params) -> SequenceGroup:
    params.setdefault("max_tokens", 6)
    params.setdefault("ignore_eos", True)
    seq = Sequence(list(range(start, start + n_prompt)), SamplingParams(**params))
    return SequenceGroup(str(start), seq, beam_params=beam)


_tokens = itertools.count(1000)


def _fake_outputs(batch) -> list[SampleOutput]:
    """What a runner would return: n tokens for a forking parent, one otherwise."""
    outs = []
    for i, seq in enumerate(batch.seqs):
        if batch.sampling[i]:
            k = seq.group.num_samples if not seq.group.forked else 1
            outs.append(SampleOutput([next(_tokens) % 90 for _ in range(k)]))
    return outs


def _run(s: Scheduler) -> list:
    batches = []
    while s.has_unfinished():
        batch = s.schedule()
        assert batch.seqs
        batches.append(batch)
        outs = _fake_outputs(batch)
        s.advance(batch)
        s.commit(batch, outs)
    return batches


def test_n_forks_after_the_prompt_and_copies_its_partial_block():
    s = _sched()
    g = _group(10, n=3)
    s.add(g)
    batch = s.schedule()
    assert batch.seqs == g.seqs and batch.num_scheduled_tokens == [10]
    s.advance(batch)
    step = s.commit(batch, [SampleOutput([7, 8, 9])])
    assert len(g.seqs) == 3 and [q.index for q in g.seqs] == [0, 1, 2]
    assert [q.output_token_ids for q in g.seqs] == [[7], [8], [9]] and step.grown == g.seqs
    prompt_blocks = list(g.seqs[0].block_table)
    assert all(q.block_table == prompt_blocks for q in g.seqs)
    assert s.block_manager.num_shared_blocks == 3
    batch = s.schedule()
    assert batch.num_scheduled_tokens == [1, 1, 1]
    # The partial third block is copied for two of the three samples; full blocks stay shared.
    assert [src for src, _ in batch.blocks_to_copy] == [prompt_blocks[2]] * 2
    assert s.block_manager.num_shared_blocks == 2
    s.advance(batch)
    s.commit(batch, [1, 2, 3])
    _run(s)
    assert all(q.num_output_tokens == 6 for q in g.seqs)
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_groups_are_preempted_and_resumed_whole(mode):
    # 12 blocks: two groups of 3 samples over a 6-token prompt cannot both grow to 14 tokens.
    s = _sched(num_blocks=12, mode=mode, cpu_blocks=32)
    a, b = _group(6, n=3, max_tokens=8), _group(6, start=20, n=3, max_tokens=8)
    s.add(a)
    s.add(b)
    swaps = []
    saw_preempted_group = False
    while s.has_unfinished():
        batch = s.schedule()
        swaps.append((len(batch.blocks_to_swap_out), len(batch.blocks_to_swap_in)))
        for g in s.waiting if mode == "recompute" else s.swapped:
            statuses = {q.status for q in g.seqs}
            assert statuses == {SequenceStatus.WAITING if mode == "recompute" else
                                SequenceStatus.SWAPPED}  # fmt: skip
            saw_preempted_group |= g.forked
        outs = _fake_outputs(batch)
        s.advance(batch)
        s.commit(batch, outs)
    assert s.num_preemptions > 0 and saw_preempted_group
    if mode == "swap":
        assert s.num_swap_outs > 0
        assert any(o for o, _ in swaps) and any(i for _, i in swaps)
        assert s.block_manager.cpu_pool.num_free_blocks == 32
    for g in (a, b):
        assert len(g.seqs) == 3 and all(q.num_output_tokens == 8 for q in g.seqs)
    assert s.block_manager.num_free_blocks == 12


def test_swap_falls_back_to_recompute_when_the_pool_is_full():
    s = _sched(num_blocks=12, mode="swap", cpu_blocks=2)
    s.add(_group(6, n=3, max_tokens=8))
    s.add(_group(6, start=20, n=3, max_tokens=8))
    _run(s)
    assert s.num_preemptions > s.num_swap_outs
    assert s.block_manager.num_free_blocks == 12


def test_a_group_samples_in_one_step_even_when_chunked():
    assert Scheduler._plan([10], 4) == [4]
    assert Scheduler._plan([3, 3], 8) == [3, 3]
    # Not enough budget for both last tokens: neither reaches it this step.
    assert Scheduler._plan([3, 3], 5) == [2, 2]
    assert Scheduler._plan([3, 3], 3) == [2, 1]


def test_beams_fork_share_and_free():
    s = _sched()
    beam = BeamSearchParams(beam_width=2, max_tokens=3)
    g = _group(6, beam=beam)
    s.add(g)
    bm = s.block_manager
    batch = s.schedule()
    # The prompt offers 4 candidates; EOS goes aside, the best two live on.
    s.advance(batch)
    s.commit(batch, [SampleOutput([5, EOS, 6, 7], [-0.1, -0.2, -0.3, -0.4])])
    assert [q.output_token_ids for q in g.seqs] == [[5], [6]]
    assert [h.token_ids for h in g.completed_beams] == [[EOS]]
    assert g.seqs[0].block_table == g.seqs[1].block_table and bm.num_shared_blocks == 2
    batch = s.schedule()
    assert len(batch.blocks_to_copy) == 1  # the shared partial block, for one of the two
    first, second = batch.seqs
    # Both survivors descend from the first beam: the second beam dies, the first forks.
    s.advance(batch)
    s.commit(
        batch,
        [SampleOutput([1, 2, 3, 4], [-0.5, -0.6, -5, -6]),
         SampleOutput([1, 2, 3, 4], [-3, -4, -5, -6])],  # fmt: skip
    )
    assert second.is_finished and second.block_table == []
    assert [q.output_token_ids for q in g.seqs] == [[5, 1], [5, 2]]
    assert g.seqs[0] is first and g.seqs[1].seq_id not in (first.seq_id, second.seq_id)
    batch = s.schedule()
    s.advance(batch)
    s.commit(batch, [SampleOutput([8, 9], [-1.0, -2.0]), SampleOutput([8, 9], [-1.0, -2.0])])
    assert g.is_finished and not s.has_unfinished()
    assert len(g.completed_beams) == 2
    # Ranked by cumulative logprob / (prompt + output length); the early EOS (length 6) wins.
    assert g.completed_beams[0].token_ids == [EOS]
    assert g.completed_beams[1].token_ids == [5, 1, 8]
    assert bm.num_free_blocks == bm.num_blocks


def test_group_admission_never_hands_out_a_block_a_sibling_hits():
    """A preempted group whose siblings differ comes back: sibling a takes fresh blocks, sibling
    b hits a cached-but-free block. The fresh block must not be the one b was promised."""
    bm = BlockManager(4, 2, True)
    sched = Scheduler(bm, 8, 64, 64, {EOS}, "recompute")
    # Block x caches [1, 2]; the blocks freed after it are cached too, so x is handed out first.
    p = Sequence([1, 2, 3], SamplingParams())
    bm.allocate(p, [], 3)
    p.num_computed_tokens = 3
    bm.cache_full_blocks(p)
    x = p.block_table[0]
    bm.free(p)
    t = Sequence([20, 21, 22, 23, 24, 25], SamplingParams())
    bm.allocate(t, [], 6)
    t.num_computed_tokens = 6
    bm.cache_full_blocks(t)
    bm.free(t)
    assert next(iter(bm.free_blocks)) == x
    a = Sequence([7, 8], SamplingParams(n=2, max_tokens=4))
    group = SequenceGroup("g", a)
    b = a.fork()
    b.token_ids = [1, 2, 5]
    group.add_child(b)
    group.mark_forked()
    sched.add(group)
    batch = sched.schedule()
    assert set(batch.seqs) == {a, b}
    assert b.block_table[0] == x  # the prefix hit
    assert x not in a.block_table
    assert not set(a.block_table) & set(b.block_table)
    assert bm.ref_counts[x] == 1
